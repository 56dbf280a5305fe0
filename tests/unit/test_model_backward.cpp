// The whole text model backward: gradients of every parameter and of the input embeddings against
// transformers 5.17.0 (golden fixture from tools/golden/model_backward.py), float64 directional
// finite differences of the whole objective (LM + MTP + balancing loss, padding, two MTP depths,
// supplied embeddings), and bit-identical gradients whether layers keep or recompute activations.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/balancing_loss.h"
#include "glmtune/model/init.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "support/random_model.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::model;
using namespace glmtune::model::text;
using glmtune::test::RandomModel;
namespace fs = std::filesystem;

namespace {

using glmtune::test::TempDir;

const fs::path kGolden =
    fs::path(GLMTUNE_SOURCE_DIR) / "tests" / "golden" / "model" / "tiny_backward.safetensors";

// Fresh every run, printed on failure; GLMTUNE_TEST_SEED reproduces a run.
uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("GLMTUNE_TEST_SEED");
    return env ? std::strtoull(env, nullptr, 10) : uint64_t(std::random_device{}());
  }();
  return seed;
}

Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }

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

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// ---------------------------------------------------------------------------------------------
// Golden parity.

TEST(ModelBackward, GradientsMatchReference) {
  const io::SafetensorsFile golden = io::SafetensorsFile::open(kGolden);
  const auto meta = nlohmann::json::parse(golden.metadata().at("fixture"));
  std::vector<std::string> sets;
  for (const auto& s : meta.at("init_sets")) sets.push_back(s.get<std::string>());
  RandomModel m("golden", meta.at("init_seed").get<uint64_t>(), sets);
  int replaced = 0;
  for (const std::string& name : golden.names()) {
    if (!name.starts_with("param.")) continue;
    const std::string param = name.substr(6);
    ASSERT_TRUE(m.store->contains(param)) << param;
    ASSERT_EQ(m.store->get(param).shape(), golden.tensor(name).shape()) << param;
    m.store->get(param) = golden.tensor(name).clone();
    ++replaced;
  }
  EXPECT_GT(replaced, 30);
  const TextModel model(*m.store);

  PackInput in;
  in.input_ids = golden.tensor("input_ids");
  in.cu_seqlens = golden.tensor("cu_seqlens");
  in.labels = golden.tensor("labels");
  TrainOptions opt;
  opt.mtp = false;  // the reference has no MTP forward
  opt.balancing_alpha = 0;
  opt.lm_denominator = golden.tensor("lm_tokens").item({0});
  TextGrads grads = TextGrads::zeros_like(model.weights());
  const StepPackResult r = forward_backward(model, in, opt, grads);

  EXPECT_NEAR(r.backward.lm_loss, golden.tensor("loss").item({0}), 1e-5);
  EXPECT_EQ(r.backward.lm_tokens, int64_t(golden.tensor("lm_tokens").item({0})));
  const double emb_err = rel_err(r.backward.d_embeddings, golden.tensor("d_embeddings"));
  EXPECT_LE(emb_err, 1e-4) << "input embeddings";

  // Every golden gradient has a C++ counterpart within the tolerance, and every trainable
  // parameter outside MTP (which the reference lacks) has a golden gradient.
  const std::string mtp_prefix = layer_prefix(model.text().num_hidden_layers);
  std::set<std::string> seen;
  double worst = 0;
  std::string worst_name;
  for (const std::string& name : golden.names()) {
    if (!name.starts_with("grad.")) continue;
    const std::string param = name.substr(5);
    const Tensor* g = grads.find(param);
    ASSERT_NE(g, nullptr) << "no gradient for " << param;
    const double err = rel_err(*g, golden.tensor(name));
    EXPECT_LE(err, 1e-4) << param;
    if (err > worst) worst = err, worst_name = param;
    seen.insert(param);
  }
  for (const auto& [name, t] : grads.named) {
    if (name.starts_with(mtp_prefix)) continue;
    EXPECT_TRUE(seen.count(name)) << name << " has no reference gradient";
  }
  EXPECT_GT(seen.size(), size_t(100));

  // The fixture exercises real sparsity: some query of the DSA layer sees fewer keys than its
  // causal prefix, so the attention gradient runs over a proper subset.
  ForwardOptions fo;
  fo.save = SavePolicy::all;
  fo.mtp = false;
  const ForwardOutput out = model.forward(in, fo);
  bool drops = false;
  for (size_t l = 0; l < out.context->layers.size(); ++l) {
    const Tensor& idx = out.context->layers[l].indices;
    if (!idx.defined()) continue;
    const std::vector<double> rows = idx.to_doubles();
    const std::vector<double> bounds = in.cu_seqlens.to_doubles();
    const int64_t width = idx.size(1);
    for (size_t d = 0; d + 1 < bounds.size(); ++d)
      for (int64_t i = int64_t(bounds[d]); i < int64_t(bounds[d + 1]); ++i) {
        int64_t keys = 0;
        for (int64_t j = 0; j < width; ++j) keys += rows[size_t(i * width + j)] >= 0 ? 1 : 0;
        drops |= keys < i - int64_t(bounds[d]) + 1;
      }
  }
  EXPECT_TRUE(drops) << "no query of the fixture loses a key to the sparse selection";
  std::printf("golden: %zu gradients, worst rel err %.3g (%s), d_embeddings %.3g, loss %.8f\n",
              seen.size(), worst, worst_name.c_str(), emb_err, r.backward.lm_loss);
}

// ---------------------------------------------------------------------------------------------
// Finite differences in float64 of the whole objective.

struct FdSetup {
  std::unique_ptr<RandomModel> random;
  std::unique_ptr<TextModel> model;  // f64
  PackInput input;
  TrainOptions opt;
};

// The objective the backward differentiates, from forward passes only: LM token mean + MTP
// (scale / K · Σ_k mean CE_k) + α · Σ routers balancing loss (main MoE layers, then each depth).
double objective(const TextModel& model, const PackInput& in, const TrainOptions& opt) {
  ForwardOptions fo;
  fo.logits = false;
  fo.mtp = opt.mtp;
  fo.mtp_depths = opt.mtp_depths;
  fo.mtp_loss_scale = opt.mtp_loss_scale;
  fo.save = SavePolicy::all;
  const ForwardOutput out = model.forward(in, fo);
  double total = out.loss() + (out.mtp ? out.mtp->loss : 0.0);
  const int64_t tokens = out.hidden.size(0);
  std::vector<uint8_t> valid(size_t(tokens), 0);
  for (int64_t i = 0; i < tokens - in.padding_tokens; ++i) valid[size_t(i)] = 1;
  model::BalancingLossOptions bo;
  bo.alpha = opt.balancing_alpha;
  bo.num_micro_packs = opt.num_micro_packs;
  bo.valid = valid;
  auto add_router = [&](const ops::Routing& r, const Tensor& bias) {
    total += model::balancing_loss(r.logits, bias, r.indices, bo, false).loss;
  };
  for (size_t l = 0; l < model.weights().layers.size(); ++l) {
    const LayerWeights& w = model.weights().layers[l];
    if (w.mlp == MlpKind::sparse)
      add_router(out.context->layers[l].routing, w.moe.e_score_correction_bias);
  }
  for (const MtpContext& m : out.context->mtp)
    add_router(m.layer.routing, model.weights().mtp->moe.e_score_correction_bias);
  return total;
}

// Smallest margin of any top-k boundary of any router (main MoE layers and MTP depths) over the
// non-padding rows: between the kept and the first dropped group score, and between the last
// chosen and the first rejected biased score among the kept groups (what moe_route compares).
double min_router_gap(const TextModel& model, const ForwardOutput& out, int64_t rows) {
  const ops::MoeConfig& cfg = model.op_configs().moe;
  const int64_t E = cfg.n_experts, G = cfg.n_group, per = E / G;
  double gap = std::numeric_limits<double>::infinity();
  auto scan = [&](const ops::Routing& r, const Tensor& bias) {
    const std::vector<double> logits = r.logits.to_doubles(), b = bias.to_doubles();
    for (int64_t t = 0; t < rows; ++t) {
      std::vector<double> score(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e)
        score[size_t(e)] = 1 / (1 + std::exp(-logits[size_t(t * E + e)])) + b[size_t(e)];
      std::vector<std::pair<double, int64_t>> groups;
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> in(score.begin() + g * per, score.begin() + (g + 1) * per);
        std::sort(in.rbegin(), in.rend());
        groups.push_back({in[0] + (per > 1 ? in[1] : 0.0), g});
      }
      std::sort(groups.rbegin(), groups.rend());
      if (cfg.topk_group < G)
        gap = std::min(
            gap, groups[size_t(cfg.topk_group - 1)].first - groups[size_t(cfg.topk_group)].first);
      std::vector<double> kept;
      for (int64_t k = 0; k < cfg.topk_group; ++k)
        for (int64_t e = 0; e < per; ++e)
          kept.push_back(score[size_t(groups[size_t(k)].second * per + e)]);
      std::sort(kept.rbegin(), kept.rend());
      if (int64_t(kept.size()) > cfg.top_k)
        gap = std::min(gap, kept[size_t(cfg.top_k - 1)] - kept[size_t(cfg.top_k)]);
    }
  };
  for (size_t l = 0; l < model.weights().layers.size(); ++l) {
    const LayerWeights& w = model.weights().layers[l];
    if (w.mlp == MlpKind::sparse)
      scan(out.context->layers[l].routing, w.moe.e_score_correction_bias);
  }
  for (const MtpContext& m : out.context->mtp)
    scan(m.layer.routing, model.weights().mtp->moe.e_score_correction_bias);
  return gap;
}

void make_fd_setup(std::mt19937_64& rng, bool with_padding, FdSetup& s) {
  // The indexer keeps every pool of these short documents (index_topk 16 covers 4 pools of 4), so
  // its selection is plain causal attention and cannot flip under a perturbation; the sparse
  // selection that drops keys is covered by the golden test. The routers' choices are kept off
  // near-ties below by redrawing the tokens.
  s.random = std::make_unique<RandomModel>("fd", rng(),
                                           std::vector<std::string>{"text_config.index_topk=16"});
  s.random->redraw_constants(rng);
  s.model = std::make_unique<TextModel>(*s.random->store, TextModelOptions{DType::f64});
  const TextConfig& c = s.model->text();
  std::vector<int64_t> lengths = {5, 9, 15};
  if (with_padding) lengths.push_back(4);  // a trailing padding document
  // Two MTP depths (one physical layer) exercise the depth-to-depth hidden path.
  s.opt.mtp = true;
  s.opt.mtp_depths = 2;
  s.opt.mtp_loss_scale = 0.3;
  s.opt.balancing_alpha = 0.05;  // large enough that its gradient is visible in the check
  s.opt.num_micro_packs = 2;
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size) - 1);
  std::bernoulli_distribution trained(0.8);
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 500) << "no token draw keeps the routers off near-ties";
    std::vector<int32_t> ids, cu = {0}, mask;
    for (size_t d = 0; d < lengths.size(); ++d) {
      const bool pad_doc = with_padding && d + 1 == lengths.size();
      for (int64_t i = 0; i < lengths[d]; ++i) {
        int32_t t = pad_doc ? int32_t(c.pad_token_id) : tok(rng);
        while (!pad_doc && t == c.pad_token_id) t = tok(rng);
        ids.push_back(t);
        mask.push_back(pad_doc ? 0 : (trained(rng) ? 1 : 0));
      }
      cu.push_back(cu.back() + int32_t(lengths[d]));
    }
    s.input.input_ids = i32(ids);
    s.input.cu_seqlens = i32(cu);
    s.input.labels = next_token_labels(s.input.input_ids, s.input.cu_seqlens, i32(mask));
    s.input.padding_tokens = with_padding ? lengths.back() : 0;
    ForwardOptions fo;
    fo.logits = false;
    fo.mtp_depths = s.opt.mtp_depths;
    fo.save = SavePolicy::all;
    const ForwardOutput out = s.model->forward(s.input, fo);
    if (min_router_gap(*s.model, out, cu.back() - s.input.padding_tokens) > 1e-3) break;
  }
}

// One directional check: `f(h)` is the objective at θ + h·v, `analytic` is ⟨g, v⟩. A central
// difference at ε is compared with the analytic slope; when it misses the bar (a strongly curved
// direction next to a small slope, e.g. through a sharp sparse-attention softmax), it is
// re-measured at ε/2 and Richardson-extrapolated, which cancels the O(ε²) error. The objective is
// only piecewise smooth (top-k selections of the routers and the indexer); when the two
// differences disagree by far more than an ε² term can explain, a selection flipped inside the
// step and the direction says nothing about the gradient (`smooth` is false: draw another). A
// wrong gradient cannot hide that way: both differences then agree with each other, not with it.
struct DirectionalCheck {
  double fd = 0;
  double err = 0;  // |fd − analytic| / (|fd| + |analytic| + 1e-4)
  bool smooth = true;
  bool extrapolated = false;
};

DirectionalCheck check_direction(const std::function<double(double)>& f, double analytic,
                                 double eps = 1e-5) {
  auto central = [&](double h) { return (f(h) - f(-h)) / (2 * h); };
  auto rel = [&](double fd) {
    return std::abs(fd - analytic) / (std::abs(fd) + std::abs(analytic) + 1e-4);
  };
  DirectionalCheck c;
  c.fd = central(eps);
  c.err = rel(c.fd);
  if (c.err <= 1e-5) return c;
  const double half = central(eps / 2);
  c.smooth = std::abs(c.fd - half) <= 1e-3 * (std::abs(c.fd) + std::abs(half) + 1e-4);
  c.fd = (4 * half - c.fd) / 3;
  c.err = rel(c.fd);
  c.extrapolated = true;
  return c;
}

TEST(ModelBackward, FiniteDifferencesFloat64) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  FdSetup s;
  make_fd_setup(rng, true, s);
  if (HasFatalFailure()) return;
  TextGrads grads = TextGrads::zeros_like(s.model->weights());
  const StepPackResult r = forward_backward(*s.model, s.input, s.opt, grads);
  // The fused losses equal the forward-only objective.
  const double f0 = objective(*s.model, s.input, s.opt);
  EXPECT_NEAR(r.backward.objective(), f0, 1e-10 * std::abs(f0));
  EXPECT_GT(r.backward.balancing_loss, 0);
  EXPECT_GT(r.backward.mtp_loss, 0);

  // Random directions per parameter tensor (another draw when a selection flipped inside the
  // step, see check_direction).
  std::normal_distribution<double> n(0.0, 1.0);
  int checked = 0, extrapolated = 0, redrawn = 0;
  double worst = 0;
  std::string worst_name;
  for (auto& [name, w] : s.model->weights().named) {
    const Tensor* g = grads.find(name);
    if (g == nullptr) continue;
    const int64_t count = w.numel();
    double* p = w.data<double>();
    const double* gp = g->data<double>();
    DirectionalCheck c;
    for (int attempt = 0; attempt < 4; ++attempt) {
      std::vector<double> v(static_cast<size_t>(count));
      for (double& x : v) x = n(rng);
      double analytic = 0;
      for (int64_t i = 0; i < count; ++i) analytic += gp[i] * v[size_t(i)];
      const std::vector<double> base(p, p + count);
      c = check_direction(
          [&](double h) {
            for (int64_t i = 0; i < count; ++i) p[i] = base[size_t(i)] + h * v[size_t(i)];
            const double value = objective(*s.model, s.input, s.opt);
            std::copy(base.begin(), base.end(), p);
            return value;
          },
          analytic);
      if (c.smooth) break;
      ++redrawn;
    }
    EXPECT_TRUE(c.smooth) << name << ": every direction crossed a selection flip";
    EXPECT_LE(c.err, 1e-5) << name << ": finite difference " << c.fd;
    extrapolated += c.extrapolated ? 1 : 0;
    if (c.err > worst) worst = c.err, worst_name = name;
    ++checked;
  }
  EXPECT_GT(checked, 100);
  std::printf(
      "finite differences: %d parameters (%d extrapolated, %d redrawn), worst rel err %.3g (%s)\n",
      checked, extrapolated, redrawn, worst, worst_name.c_str());
}

TEST(ModelBackward, InputEmbeddingGradientFiniteDifferences) {
  // The supplied-embedding path (vision splice): the gradient of the input rows, including MTP's
  // rolled future rows (zero rows past a document's end).
  std::mt19937_64 rng(test_seed() + 1);
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  FdSetup s;
  make_fd_setup(rng, false, s);
  if (HasFatalFailure()) return;
  const Tensor emb = s.model->embed(s.input.input_ids);
  s.input.inputs_embeds = emb.clone();
  TextGrads grads = TextGrads::zeros_like(s.model->weights());
  const StepPackResult r = forward_backward(*s.model, s.input, s.opt, grads);
  // The token lookup is not differentiated on this path.
  const std::vector<double> ge = grads.embed_tokens.to_doubles();
  double lookup = 0;
  for (double x : ge) lookup = std::max(lookup, std::abs(x));
  const double head =
      rel_err(grads.lm_head.weight, Tensor::zeros(grads.lm_head.weight.shape(), DType::f64));
  EXPECT_GT(head, 0);
  EXPECT_EQ(lookup, 0.0);

  std::normal_distribution<double> n(0.0, 1.0);
  const std::vector<double> base = emb.to_doubles();
  const double* g = r.backward.d_embeddings.data<double>();
  DirectionalCheck c;
  for (int attempt = 0; attempt < 4 && (attempt == 0 || !c.smooth); ++attempt) {
    std::vector<double> v(base.size());
    for (double& x : v) x = n(rng);
    double analytic = 0;
    for (size_t i = 0; i < v.size(); ++i) analytic += g[i] * v[i];
    c = check_direction(
        [&](double h) {
          std::vector<double> e = base;
          for (size_t i = 0; i < e.size(); ++i) e[i] += h * v[i];
          PackInput in = s.input;
          in.inputs_embeds = Tensor::from_doubles(e, emb.shape(), DType::f64);
          return objective(*s.model, in, s.opt);
        },
        analytic);
  }
  EXPECT_TRUE(c.smooth) << "every direction crossed a selection flip";
  EXPECT_LE(c.err, 1e-5) << "finite difference " << c.fd;
}

// ---------------------------------------------------------------------------------------------
// Activation policy.

TEST(ModelBackward, KeepAndRecomputeGiveIdenticalGradients) {
  std::mt19937_64 rng(test_seed() + 2);
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  RandomModel m("policy", rng());
  m.redraw_constants(rng);
  const TextModel model(*m.store);
  const TextConfig& c = model.text();
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size) - 1);
  std::vector<int32_t> ids;
  for (int i = 0; i < 48; ++i) ids.push_back(tok(rng) == c.pad_token_id ? 1 : tok(rng));
  PackInput in;
  in.input_ids = i32(ids);
  in.cu_seqlens = i32({0, 17, 40, 48});
  in.labels = next_token_labels(in.input_ids, in.cu_seqlens);
  in.padding_tokens = 8;

  TrainOptions keep;
  keep.balancing_alpha = 0.001;
  TrainOptions all = keep;
  all.activations = activation_policy(c.num_hidden_layers, 1.0);
  all.recompute_mtp = true;
  TrainOptions some = keep;
  some.activations = activation_policy(c.num_hidden_layers, 0.4);
  EXPECT_EQ(
      std::count(some.activations.begin(), some.activations.end(), ActivationPolicy::recompute), 2);

  TextGrads gk = TextGrads::zeros_like(model.weights());
  TextGrads ga = TextGrads::zeros_like(model.weights());
  TextGrads gs = TextGrads::zeros_like(model.weights());
  TextGrads gf = TextGrads::zeros_like(model.weights());
  const StepPackResult rk = forward_backward(model, in, keep, gk);
  const StepPackResult ra = forward_backward(model, in, all, ga);
  const StepPackResult rs = forward_backward(model, in, some, gs);
  // The backward also runs from TextModel::forward's own context.
  ForwardOptions fo;
  fo.save = SavePolicy::all;
  fo.logits = false;
  const ForwardOutput out = model.forward(in, fo);
  const BackwardResult rf = backward(model, in, *out.context, keep, gf);

  EXPECT_EQ(rk.backward.objective(), ra.backward.objective());
  EXPECT_EQ(rk.backward.objective(), rs.backward.objective());
  EXPECT_EQ(rk.backward.objective(), rf.objective());
  EXPECT_NEAR(rk.backward.lm_loss, out.loss(), 1e-5);
  EXPECT_TRUE(same_bits(rk.backward.d_embeddings, ra.backward.d_embeddings));
  EXPECT_TRUE(same_bits(rk.backward.d_embeddings, rs.backward.d_embeddings));
  ASSERT_EQ(gk.named.size(), ga.named.size());
  double total = 0;
  for (size_t i = 0; i < gk.named.size(); ++i) {
    const std::string& name = gk.named[i].first;
    EXPECT_TRUE(same_bits(gk.named[i].second, ga.named[i].second)) << name << " (recompute all)";
    EXPECT_TRUE(same_bits(gk.named[i].second, gs.named[i].second)) << name << " (recompute 40%)";
    EXPECT_TRUE(same_bits(gk.named[i].second, gf.named[i].second)) << name << " (model context)";
    for (double x : gk.named[i].second.to_doubles()) total += std::abs(x);
  }
  EXPECT_GT(total, 0);
  // Expert loads are reported for every MoE layer and the MTP router, padding excluded.
  const int64_t moe_layers = c.count(MlpKind::sparse);
  ASSERT_EQ(int64_t(rk.loads.size()), moe_layers + 1);
  for (const RouterLoads& l : rk.loads) {
    int64_t sum = 0;
    for (double x : l.counts.to_doubles()) sum += int64_t(x);
    EXPECT_EQ(sum, (48 - 8) * c.num_experts_per_tok) << l.bias_name;
  }
}

TEST(ModelBackward, GradientsAccumulateOverMicroPacks) {
  // Two packs with the step's global denominator give the gradient of one pack holding both.
  std::mt19937_64 rng(test_seed() + 3);
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  RandomModel m("accum", rng());
  const TextModel model(*m.store, TextModelOptions{DType::f64});
  const TextConfig& c = model.text();
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size) - 1);
  std::vector<int32_t> a, b;
  for (int i = 0; i < 19; ++i) a.push_back(tok(rng) == c.pad_token_id ? 1 : tok(rng));
  for (int i = 0; i < 26; ++i) b.push_back(tok(rng) == c.pad_token_id ? 1 : tok(rng));
  auto pack = [](const std::vector<int32_t>& ids, const std::vector<int32_t>& cu) {
    PackInput in;
    in.input_ids = i32(ids);
    in.cu_seqlens = i32(cu);
    in.labels = next_token_labels(in.input_ids, in.cu_seqlens);
    return in;
  };
  std::vector<int32_t> ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  TrainOptions opt;  // no balancing loss: it is per micro-pack by definition
  opt.lm_denominator = 18 + 25;
  opt.mtp_denominators = {17 + 24};
  TextGrads split = TextGrads::zeros_like(model.weights());
  TextGrads whole = TextGrads::zeros_like(model.weights());
  const double la = forward_backward(model, pack(a, {0, 19}), opt, split).backward.objective();
  const double lb = forward_backward(model, pack(b, {0, 26}), opt, split).backward.objective();
  const double lab =
      forward_backward(model, pack(ab, {0, 19, 45}), opt, whole).backward.objective();
  EXPECT_NEAR(la + lb, lab, 1e-12);
  for (size_t i = 0; i < split.named.size(); ++i)
    EXPECT_LE(rel_err(split.named[i].second, whole.named[i].second), 1e-10) << split.named[i].first;
}

}  // namespace

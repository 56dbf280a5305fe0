// Sequence parallelism under mpirun against the single-process step: each pack is split over an
// sp group of 2 (contiguous shards, document boundaries inside shards and across them, a shard
// border inside a document, odd pack lengths, a trailing padding document), KDA and DSA exchange
// across the shards, and the summed loss terms, expert loads and every parameter gradient equal
// what one process computes from whole packs. On 4 ranks the same with dp = 2 × sp = 2, and with
// expert parallelism on top (ep groups of 2); and with fully sharded decoder layers over dp (the sp
// group's partial gradients summed into the slices), alone and with expert parallelism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../unit/support/temp_dir.h"
#include "dist_support.h"
#include "glmtune/base/error.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/dist/expert_shards.h"
#include "glmtune/dist/fsdp.h"
#include "glmtune/dist/sequence_parallel.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/train/optimizer.h"
#include "mpi_main.h"

namespace glmtune::dist {
namespace {

namespace fs = std::filesystem;
using dist_test::count_targets;
using dist_test::rel_diff;
using dist_test::run_packs;
using dist_test::Step;
using model::text::PackInput;

constexpr int64_t kPacksPerGroup = 3;

// Pack `index`, four shapes in turn (shard borders of 2 ranks in brackets):
//   0  three documents, odd length 37 [18]: the border inside the second document;
//   1  documents of 1, 2, 3 and 8 tokens, then 26 padding rows [20]: the second shard is padding
//      only, the first holds the short documents and some padding;
//   2  one document of 45 tokens across the border [24], then 3 padding rows;
//   3  documents of 12, 18, 10 tokens [20].
PackInput random_pack(int64_t index, int64_t vocab, int32_t pad_id) {
  std::mt19937_64 rng(4321 + 31 * uint64_t(index));
  static const std::vector<std::vector<int32_t>> shapes = {
      {0, 7, 21, 37}, {0, 1, 3, 6, 14, 40}, {0, 45, 48}, {0, 12, 30, 40}};
  static const std::vector<int32_t> padding = {0, 26, 3, 0};
  const std::vector<int32_t>& cu = shapes[size_t(index % 4)];
  const int32_t pad_rows = padding[size_t(index % 4)];
  const bool padded = pad_rows > 0;
  const int64_t t = cu.back();
  std::vector<int32_t> ids(static_cast<size_t>(t));
  std::vector<int32_t> labels(static_cast<size_t>(t), model::kIgnoreLabel);
  for (auto& v : ids) v = int32_t(rng() % uint64_t(vocab));
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i + 1 < cu[d + 1]; ++i)
      if (rng() % 5 != 0) labels[size_t(i)] = ids[size_t(i) + 1];
  PackInput in;
  if (padded) {
    for (int64_t i = t - pad_rows; i < t; ++i) {
      ids[size_t(i)] = pad_id;
      labels[size_t(i)] = model::kIgnoreLabel;
    }
    in.padding_tokens = pad_rows;
  }
  in.input_ids = Tensor::from_vector(ids, {t});
  in.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())});
  in.labels = Tensor::from_vector(labels, {t});
  return in;
}

struct Tiny {
  std::unique_ptr<test::TempDir> dir;
  std::unique_ptr<model::ParamStore> store;
  std::unique_ptr<model::text::TextModel> model;
};

// `experts`: the routed experts to load (an expert-parallel rank's slice); nullopt for all.
std::unique_ptr<model::ParamStore> load_store(const fs::path& dir,
                                              std::optional<model::ExpertRange> experts) {
  auto store = std::make_unique<model::ParamStore>(model::ParamStore::load(
      io::CheckpointReader::open(dir),
      model::ModelConfig::from_file((dir / "config.json").string()), experts));
  train::make_params_writable(*store);
  return store;
}

// The tiny model; `variant` makes its last layer a DSA layer that reuses layer 3's selection (the
// carried indices) and gives attention biases (the o_proj bias must count once over the heads).
Tiny tiny_model(int rank, DType dtype, bool variant) {
  Tiny t;
  t.dir = std::make_unique<test::TempDir>("dist-sp-" + std::to_string(rank));
  model::InitOptions init;
  init.seed = 5;
  model::ModelConfig config = model::ModelConfig::preset("tiny");
  if (variant)
    config.set_all({{"text_config.layer_types",
                     R"(["linear_attention", "linear_attention", "linear_attention",
                         "deepseek_sparse_attention", "deepseek_sparse_attention"])"},
                    {"text_config.indexer_types", R"(["full", "full", "full", "full", "shared"])"},
                    {"text_config.attention_bias", "true"}});
  model::write_random_checkpoint(config, *t.dir / "tiny", init);
  t.store = load_store(*t.dir / "tiny", std::nullopt);
  t.model =
      std::make_unique<model::text::TextModel>(*t.store, model::text::TextModelOptions{dtype});
  return t;
}

// `step_denominators`: the step's global counts (as the trainer passes them); false: none, so that
// each split pack counts its own targets over the sp group (compared relative to the sums).
// `fsdp`: the decoder layers (but the routed-expert slices) held in slices over the dp group
// (dist/fsdp.h), the sp group's partial gradients summed into the slices.
void check_one_step(bool step_denominators, DType dtype, double tolerance, bool variant = false,
                    int64_t ep_size = 1, bool fsdp = false) {
  ParallelOptions options;
  options.sp_size = 2;
  options.ep_size = ep_size;
  options.timeout_s = 300;
  const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
  ASSERT_EQ(par->sizes().sp, 2) << "run under mpirun with 2 or 4 ranks";
  const Tiny tiny = tiny_model(par->rank(), dtype, variant);
  if (variant) {
    ASSERT_EQ(tiny.model->text().indexer_types[4], model::IndexerKind::shared);
    ASSERT_TRUE(tiny.model->weights().layers[4].dsa.mla.o_proj.bias.defined());
  }
  const model::text::TextModel& m = *tiny.model;
  const int32_t pad = int32_t(m.text().pad_token_id);

  const int64_t groups = par->sizes().dp, packs_total = kPacksPerGroup * groups;
  std::vector<PackInput> all;
  for (int64_t i = 0; i < packs_total; ++i) all.push_back(random_pack(i, 2000, pad));
  model::text::TrainOptions topt;
  topt.activations = model::text::activation_policy(m.text().num_hidden_layers, 0.4);
  topt.recompute_mtp = true;
  topt.mtp = m.has_mtp();
  topt.mtp_depths = m.text().num_nextn_predict_layers;
  ASSERT_GT(topt.mtp_depths, 0);
  topt.balancing_alpha = 0.001;
  topt.num_micro_packs = packs_total;
  if (step_denominators) {
    int64_t lm_targets = 0;
    std::vector<int64_t> mtp_targets(size_t(topt.mtp_depths), 0);
    for (const auto& in : all) {
      lm_targets += count_targets(in.labels);
      for (int64_t k = 1; k <= topt.mtp_depths; ++k)
        mtp_targets[size_t(k - 1)] +=
            count_targets(model::shift_labels(in.labels, in.cu_seqlens, k));
    }
    topt.lm_denominator = double(lm_targets);
    for (int64_t n : mtp_targets) topt.mtp_denominators.push_back(double(n));
  }

  // Single process: every pack whole. With per-pack denominators the reference's loss terms are
  // per-pack means, as are the split run's.
  model::text::TextGrads ref_grads = model::text::TextGrads::zeros_like(m.weights());
  const Step ref = run_packs(m, all, topt, ref_grads);

  // This sp group's packs, split over its ranks.
  const int64_t d = par->dp().rank();
  const std::vector<PackInput> mine(all.begin() + d * kPacksPerGroup,
                                    all.begin() + (d + 1) * kPacksPerGroup);
  const UlyssesParallel ulysses(par->sp(), m.text().linear_num_heads, m.text().num_attention_heads,
                                "test");
  topt.sequence_parallel = &ulysses;
  // With expert parallelism this rank's model holds its slice of the routed experts only.
  std::optional<ExpertParallel> experts;
  std::unique_ptr<model::ParamStore> sliced_store;
  std::optional<LocalExperts> local;
  std::unique_ptr<model::text::TextModel> sliced;
  if (ep_size > 1) {
    experts.emplace(par->ep(), m.text().n_routed_experts, "test");
    sliced_store = load_store(*tiny.dir / "tiny", local_range(*experts));
    local.emplace(*sliced_store, *experts);
    sliced = std::make_unique<model::text::TextModel>(*sliced_store,
                                                      model::text::TextModelOptions{dtype});
    topt.expert_dispatch = &*experts;
  }
  model::text::TextModel& my_model = sliced ? *sliced : *tiny.model;
  const auto is_slice = [&](const std::string& name) { return local && local->holds(name); };
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(my_model.weights());
  // The reference ran already: the whole model may give its decoder layers to the slices now.
  std::optional<ShardedLayers> layers;
  if (fsdp) {
    layers.emplace(
        my_model.weights(), grads, par->dp(),
        LayerSource{[](const std::string&) -> std::optional<Shape> { return std::nullopt; },
                    nullptr, is_slice});
    topt.layer_params = &*layers;
  }
  const Step got = run_packs(my_model, mine, topt, grads);

  // The shards really split the pack: this rank's part of the LM loss is not the whole.
  std::vector<double> sums = {got.lm, got.balancing};
  sums.insert(sums.end(), got.mtp.begin(), got.mtp.end());
  par->world().all_reduce_sum(sums);
  const double lm_scale = step_denominators ? topt.lm_denominator : std::abs(ref.lm);
  EXPECT_NEAR(sums[0] / lm_scale, ref.lm / lm_scale, 1e-6);
  EXPECT_NE(got.lm, sums[0]);
  EXPECT_GT(ref.balancing, 0);
  EXPECT_NEAR(sums[1], ref.balancing, 1e-6 * std::max(1.0, ref.balancing));
  for (size_t k = 0; k < got.mtp.size(); ++k) {
    const double scale = step_denominators ? topt.mtp_denominators[k] : std::abs(ref.mtp[k]);
    EXPECT_NEAR(sums[2 + k] / scale, ref.mtp[k] / scale, 1e-6);
  }
  ASSERT_EQ(got.loads.size(), ref.loads.size());
  for (const auto& [name, counts] : got.loads) {
    std::vector<int64_t> summed = counts;
    par->world().all_reduce_sum(summed);
    EXPECT_EQ(summed, ref.loads.at(name)) << name;
  }

  // Every gradient, summed over sp (shards and heads) and dp (packs).
  ASSERT_FALSE(grads.named.empty());
  // In f32, the split changes how sums over tokens are grouped (per shard, then over the shards),
  // so the gradients are held to the accuracy f32 has here at all: measured against the f64
  // gradients of the same step, the split run's error stays within regrouped_f32_bar (3× the
  // largest error of the single-process f32 run, which reaches 1e-5 where per-token terms cancel,
  // e.g. the mHC scale gradients, and at least 1e-4), and each gradient within `tolerance` of the
  // single-process f32 gradient (the two
  // f32 runs can both be 1e-5 away from the f64 values, in different directions).
  model::text::TextGrads exact;
  double ref_error = 0;
  if (dtype == DType::f32) {
    const Tiny wide = tiny_model(par->rank(), DType::f64, variant);
    exact = model::text::TextGrads::zeros_like(wide.model->weights());
    model::text::TrainOptions wide_opt = topt;
    wide_opt.sequence_parallel = nullptr;
    wide_opt.layer_params = nullptr;
    wide_opt.expert_dispatch = nullptr;
    run_packs(*wide.model, all, wide_opt, exact);
    for (size_t i = 0; i < ref_grads.named.size(); ++i)
      ref_error = std::max(ref_error, rel_diff(ref_grads.named[i].second, exact.named[i].second));
    EXPECT_LT(ref_error, 1e-4);
  }
  // An expert slice's gradient is summed over the ranks holding it (sp, then edp) and compared
  // with the same experts of the single-process gradient. With fsdp the decoder layers' gradients
  // were reduce-scattered over dp in the backward; summed over sp (as the trainer does once per
  // step) and gathered, they are the whole step's.
  std::map<std::string, Tensor> summed;
  for (size_t i = 0; i < grads.named.size(); ++i) {
    const std::string& name = grads.named[i].first;
    if (!grads.named[i].second.defined()) {
      EXPECT_TRUE(layers.has_value()) << name << " has no gradient";
      continue;
    }
    Tensor g = grads.named[i].second.clone();
    if (is_slice(name)) {
      par->sp().all_reduce(g);
      par->edp().all_reduce(g);
    } else {
      par->world().all_reduce(g);
    }
    summed[name] = g;
  }
  if (layers) {
    layers->all_reduce_gradients(par->sp());
    layers->gather_gradients([&](const std::string& name, const Tensor& g) {
      EXPECT_FALSE(is_slice(name)) << name;
      EXPECT_TRUE(summed.emplace(name, g.clone()).second) << name << " twice";
    });
    // Bytes per rank: 1/dp of the layers (the sp ranks of a group hold the same slices), up to the
    // layout's padding of fewer than dp elements per layer.
    const int64_t dp = par->sizes().dp, num_layers = layers->layers();
    const int64_t padding = num_layers * dp * int64_t(dtype_size(dtype));
    EXPECT_GE(layers->resident_bytes(), layers->full_bytes() / dp);
    EXPECT_LE(layers->resident_bytes(), layers->full_bytes() / dp + padding);
    // Gradient slices only for the trained tensors (the indexer and the router biases sit in
    // flats without gradients): 1/dp of those, up to the same padding.
    EXPECT_LT(layers->full_gradient_bytes(), layers->full_bytes());
    EXPECT_GE(layers->gradient_bytes(), layers->full_gradient_bytes() / dp);
    EXPECT_LE(layers->gradient_bytes(), layers->full_gradient_bytes() / dp + padding);
    if (par->is_root())
      std::printf("fsdp, dp %lld x sp 2%s: %lld of %lld bytes of decoder-layer weights per rank\n",
                  static_cast<long long>(dp), ep_size > 1 ? " x ep 2" : "",
                  static_cast<long long>(layers->resident_bytes()),
                  static_cast<long long>(layers->full_bytes()));
  }
  ASSERT_EQ(summed.size(), ref_grads.named.size());
  for (const auto& [name, g] : summed) {
    const auto part = [&](const Tensor& whole) {
      return is_slice(name) ? whole.narrow(0, experts->first_expert(), experts->local_experts())
                            : whole;
    };
    EXPECT_LE(rel_diff(g, part(*ref_grads.find(name))), tolerance) << name;
    if (dtype == DType::f32)
      EXPECT_LE(rel_diff(g, part(*exact.find(name))), dist_test::regrouped_f32_bar(ref_error))
          << name;
  }
}

// Fully sharded decoder layers over dp (a group of one on 2 ranks, dp 2 × sp 2 on 4): the sp
// group's ranks gather the same slices and add their partial gradients into them.
TEST(DistSequenceParallel, WithFsdpInF64) {
  check_one_step(true, DType::f64, 1e-10, false, 1, true);
}

TEST(DistSequenceParallel, WithFsdp) { check_one_step(true, DType::f32, 1e-4, false, 1, true); }

TEST(DistSequenceParallel, WithFsdpAndExpertParallelInF64) {
  if (testing::world_context()->sizes().world != 4) GTEST_SKIP() << "needs 4 ranks";
  check_one_step(true, DType::f64, 1e-10, false, 2, true);
}

// In f64 the split step is the single-process step up to rounding: a row, head or boundary that
// went to the wrong place would show as an O(1) difference.
TEST(DistSequenceParallel, OneStepEqualsTheSingleProcessStepInF64) {
  check_one_step(true, DType::f64, 1e-10);
}

// A layer that reuses its predecessor's selection, and attention biases.
TEST(DistSequenceParallel, SharedIndexerAndAttentionBiasInF64) {
  check_one_step(true, DType::f64, 1e-10, true);
}

// With expert parallelism as well (4 ranks: dp 2 × sp 2, ep groups of 2 over the dp index): each
// shard's tokens travel to their experts' ranks.
TEST(DistSequenceParallel, WithExpertParallelInF64) {
  if (testing::world_context()->sizes().world != 4) GTEST_SKIP() << "needs 4 ranks";
  check_one_step(true, DType::f64, 1e-10, false, 2);
}

// In f32 the losses and loads agree within 1e-6; gradients as explained in check_one_step.
TEST(DistSequenceParallel, OneStepEqualsTheSingleProcessStep) {
  check_one_step(true, DType::f32, 1e-4);
}

TEST(DistSequenceParallel, PackDenominatorsCountTheWholePack) {
  check_one_step(false, DType::f32, 1e-4);
}

// The heads must split over the group, and a pack must give every rank a row.
TEST(DistSequenceParallel, RefusesSplitsThatDoNotFit) {
  ParallelContext& par = *testing::world_context();
  try {
    UlyssesParallel sp(par.world(), 2 * par.sizes().world + 1, 2 * par.sizes().world,
                       "recipe.toml: train.sp_size");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("do not split over"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("train.sp_size"), std::string::npos) << e.what();
  }
  const UlyssesParallel sp(par.world(), par.sizes().world, par.sizes().world, "test");
  EXPECT_THROW(sp.shard_begin(par.sizes().world - 1), Error);
  // Shards tile the pack in rank order.
  std::vector<int64_t> rows = {sp.shard_rows(11)};
  par.world().all_reduce_sum(rows);
  EXPECT_EQ(rows[0], 11);
  EXPECT_EQ(sp.shard_begin(11), 11 * par.rank() / par.sizes().world);
}

// The exchanges themselves: a gather of the shards is the pack, a reduce-scatter sums each
// shard's rows over the ranks.
TEST(DistSequenceParallel, GatherAndReduceScatterRows) {
  ParallelContext& par = *testing::world_context();
  const UlyssesParallel sp(par.world(), par.sizes().world, par.sizes().world, "test");
  const int64_t tokens = 13, width = 3;
  const int64_t begin = sp.shard_begin(tokens), rows = sp.shard_rows(tokens);
  std::vector<float> mine;
  for (int64_t i = 0; i < rows * width; ++i) mine.push_back(float(begin * width + i));
  const Tensor full = sp.all_gather_rows(Tensor::from_vector(mine, {rows, width}), tokens);
  ASSERT_EQ(full.shape(), (Shape{tokens, width}));
  for (int64_t i = 0; i < tokens * width; ++i) EXPECT_EQ(full.data<float>()[i], float(i));
  const Tensor back = sp.reduce_scatter_rows(full);
  ASSERT_EQ(back.shape(), (Shape{rows, width}));
  for (int64_t i = 0; i < rows * width; ++i)
    EXPECT_EQ(back.data<float>()[i], float(par.sizes().world) * mine[size_t(i)]);
}

}  // namespace
}  // namespace glmtune::dist

int main(int argc, char** argv) { return glmtune::dist::testing::run_all_tests(argc, argv); }

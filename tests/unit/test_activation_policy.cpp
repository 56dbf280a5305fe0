// The per-layer activation policy: how the recipe's `recompute` and `offload` fractions split the
// decoder layers (recompute first, offload next, keep the rest), the recipe keys and their
// errors, and offload on the CPU, where it keeps the layer: the same context and the same gradient
// bits as keep. The GPU side (copies to pinned host memory) is tests/unit/test_cuda_offload.cpp.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/train/recipe.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::model;
using namespace glmtune::model::text;

namespace {

constexpr ActivationPolicy R = ActivationPolicy::recompute;
constexpr ActivationPolicy O = ActivationPolicy::offload;
constexpr ActivationPolicy K = ActivationPolicy::keep;

std::string recipe_with(const std::string& train_lines) {
  return "[model]\npath = \"m\"\n[data]\nfiles = [\"a.jsonl\"]\n[train]\ntotal_steps = 10\n" +
         train_lines + "\n[output]\ndir = \"out\"\n";
}

Error recipe_error(const std::string& train_lines) {
  try {
    train::Recipe::parse(recipe_with(train_lines), "r.toml");
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected an error for: " << train_lines;
  return Error("");
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

}  // namespace

TEST(ActivationPolicy, RecomputeFirstThenOffloadThenKeep) {
  EXPECT_EQ(activation_policy(5, 0.4, 0.4), (std::vector{R, R, O, O, K}));
  EXPECT_EQ(activation_policy(5, 0, 1), (std::vector{O, O, O, O, O}));
  EXPECT_EQ(activation_policy(5, 1, 0), (std::vector{R, R, R, R, R}));
  EXPECT_EQ(activation_policy(5, 0, 0), (std::vector{K, K, K, K, K}));
  // Each fraction rounds down on its own, as the reference trainer's recompute_ratio does.
  EXPECT_EQ(activation_policy(5, 0.5, 0.5), (std::vector{R, R, O, O, K}));
  EXPECT_EQ(activation_policy(4, 0.3, 0.7), (std::vector{R, O, O, K}));
  EXPECT_EQ(activation_policy(3, 0.2), (std::vector{K, K, K}));
  try {
    activation_policy(5, 0.7, 0.5);
    ADD_FAILURE() << "fractions adding up to 1.2 were accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("more than every layer"), std::string::npos) << e.problem();
  }
}

TEST(ActivationPolicy, RecipeKeyOffload) {
  const train::Recipe defaults = train::Recipe::parse(recipe_with(""), "r.toml");
  EXPECT_EQ(defaults.offload, 0.0);
  EXPECT_EQ(defaults.recompute, 1.0);

  const train::Recipe all =
      train::Recipe::parse(recipe_with("recompute = \"none\"\noffload = \"all\""), "r.toml");
  EXPECT_EQ(all.recompute, 0.0);
  EXPECT_EQ(all.offload, 1.0);
  const train::Recipe mixed =
      train::Recipe::parse(recipe_with("recompute = 0.25\noffload = 0.5"), "r.toml");
  EXPECT_EQ(mixed.offload, 0.5);
  const train::Recipe none = train::Recipe::parse(recipe_with("offload = \"none\""), "r.toml");
  EXPECT_EQ(none.offload, 0.0);

  // The effective recipe says it, and reads back the same.
  for (const train::Recipe* r : {&defaults, &all, &mixed}) {
    const train::Recipe back = train::Recipe::parse(r->to_toml(), "back.toml");
    EXPECT_EQ(back.offload, r->offload);
    EXPECT_EQ(back.recompute, r->recompute);
  }
  EXPECT_NE(all.to_toml().find("offload = \"all\""), std::string::npos) << all.to_toml();
  EXPECT_NE(mixed.to_toml().find("offload = 0.5"), std::string::npos) << mixed.to_toml();

  // --set reaches it, and the sum is checked again.
  train::Recipe set = defaults;
  set.set("train.recompute", "none");
  set.set("train.offload", "0.6");
  EXPECT_EQ(set.offload, 0.6);
}

TEST(ActivationPolicy, RecipeErrorsNameTheKeyAndTheFix) {
  // The default recompute = "all" leaves no layer to offload.
  const Error sum = recipe_error("offload = 0.5");
  EXPECT_NE(sum.problem().find("add up to more than every layer"), std::string::npos)
      << sum.problem();
  EXPECT_NE(sum.where().find("train.offload"), std::string::npos) << sum.where();
  EXPECT_NE(sum.fix().find("lower recompute to 0.5 or less"), std::string::npos) << sum.fix();

  const Error range = recipe_error("recompute = \"none\"\noffload = 1.5");
  EXPECT_NE(range.problem().find("[0, 1]"), std::string::npos) << range.problem();
  EXPECT_NE(range.where().find("r.toml:8: train.offload"), std::string::npos) << range.where();

  const Error type = recipe_error("offload = true");
  EXPECT_NE(type.problem().find("\"all\", \"none\" or a number in [0, 1]"), std::string::npos)
      << type.problem();
  EXPECT_NE(type.fix().find("offload = "), std::string::npos) << type.fix();

  const Error word = recipe_error("offload = \"half\"");
  EXPECT_NE(word.problem().find("accepted: all, none"), std::string::npos) << word.problem();
}

TEST(ActivationPolicy, OffloadOnTheCpuKeepsTheLayerWithTheSameGradients) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ModelConfig config = ModelConfig::preset("tiny");
  test::TempDir dir("offload-cpu");
  InitOptions init;
  init.seed = seed;
  write_random_checkpoint(config, dir.path() / "ck", init);
  const ParamStore store = ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
  const TextModel model(store);
  const int64_t layers = model.text().num_hidden_layers;

  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(1, int32_t(model.text().vocab_size) - 1);
  const std::vector<int32_t> cu = {0, 23, 40, 48};
  std::vector<int32_t> ids(48), labels(48, -100);
  for (int32_t& id : ids) id = token(rng);
  for (size_t d = 0; d + 2 < cu.size(); ++d)
    for (int32_t i = cu[d]; i + 1 < cu[d + 1]; ++i) labels[size_t(i)] = ids[size_t(i + 1)];
  PackInput in;
  in.input_ids = Tensor::from_vector(ids, {48});
  in.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())});
  in.labels = Tensor::from_vector(labels, {48});
  in.padding_tokens = 8;

  TrainOptions keep;
  keep.balancing_alpha = 0.001;
  TrainOptions offload = keep;
  offload.activations = activation_policy(layers, 0, 1);
  TrainOptions mixed = keep;
  mixed.activations = activation_policy(layers, 0.4, 0.4);

  // The context of an offloaded layer is the kept one: whole, in host memory, marked keep.
  const TrainForward f = training_forward(model, in, offload);
  ASSERT_EQ(int64_t(f.context->policies.size()), layers);
  for (int64_t l = 0; l < layers; ++l) {
    EXPECT_EQ(f.context->policies[size_t(l)], ActivationPolicy::keep) << "layer " << l;
    EXPECT_TRUE(f.context->layers[size_t(l)].attn_in.defined()) << "layer " << l;
    EXPECT_TRUE(f.context->layers[size_t(l)].attn_in.device().is_cpu()) << "layer " << l;
  }
  const TrainForward fm = training_forward(model, in, mixed);
  EXPECT_EQ(fm.context->policies[0], ActivationPolicy::recompute);
  EXPECT_FALSE(fm.context->layers[0].attn_in.defined());
  EXPECT_EQ(fm.context->policies[size_t(layers) - 1], ActivationPolicy::keep);

  TextGrads gk = TextGrads::zeros_like(model.weights());
  TextGrads go = TextGrads::zeros_like(model.weights());
  TextGrads gm = TextGrads::zeros_like(model.weights());
  const StepPackResult rk = forward_backward(model, in, keep, gk);
  const StepPackResult ro = forward_backward(model, in, offload, go);
  const StepPackResult rm = forward_backward(model, in, mixed, gm);
  EXPECT_EQ(rk.backward.objective(), ro.backward.objective());
  EXPECT_EQ(rk.backward.objective(), rm.backward.objective());
  ASSERT_EQ(gk.named.size(), go.named.size());
  double total = 0;
  for (size_t i = 0; i < gk.named.size(); ++i) {
    const std::string& name = gk.named[i].first;
    EXPECT_TRUE(same_bits(gk.named[i].second, go.named[i].second)) << name << " (offload)";
    EXPECT_TRUE(same_bits(gk.named[i].second, gm.named[i].second)) << name << " (mixed)";
    for (double x : gk.named[i].second.to_doubles()) total += std::abs(x);
  }
  EXPECT_GT(total, 0);
}

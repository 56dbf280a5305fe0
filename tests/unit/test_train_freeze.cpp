// train.freeze: which parameters the patterns freeze and the errors for patterns that cannot be
// honoured; frozen parameters get no gradient while every other gradient stays bit for bit what it
// was; and training runs (whole layers and fully sharded ones) that leave the frozen tensors
// byte-identical in their checkpoints, train the rest and keep no optimizer state for them.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/fp8.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/fp8_layers.h"
#include "glmtune/model/text/model.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/train/freeze.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer.h"
#include "support/error_message.h"
#include "support/frozen_experts.h"
#include "support/temp_dir.h"

using namespace glmtune;
namespace fs = std::filesystem;
using glmtune::test::TempDir;

namespace {

const fs::path kSource = GLMTUNE_SOURCE_DIR;
const char* const kExperts = "mlp\\.experts\\.";

// One tiny checkpoint for the whole binary (init is deterministic for a seed).
const fs::path& tiny_model() {
  static TempDir dir("freeze-model");
  static const fs::path path = [] {
    const fs::path p = dir.path() / "tiny";
    model::InitOptions options;
    options.seed = 5;
    model::write_random_checkpoint(model::ModelConfig::preset("tiny"), p, options);
    return p;
  }();
  return path;
}

std::string bytes_of(const Tensor& t) {
  const Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), size_t(c.nbytes()));
}

model::ParamStore load_tiny() {
  return model::ParamStore::load(
      io::CheckpointReader::open(tiny_model()),
      model::ModelConfig::from_file((tiny_model() / "config.json").string()));
}

TEST(Freeze, PatternsFreezeWholeInternalTensors) {
  model::ParamStore store = load_tiny();
  const train::FreezePlan plan =
      train::apply_freeze(store, {kExperts, "embed_tokens"}, "recipe: train.freeze");
  std::set<std::string> frozen(plan.frozen.begin(), plan.frozen.end());
  int64_t experts = 0;
  for (const model::InternalParam& p : store.params()) {
    const bool want = model::is_fused_expert_tensor(p.name) ||
                      p.name == "model.language_model.embed_tokens.weight";
    EXPECT_EQ(frozen.count(p.name) == 1, want) << p.name;
    if (want) EXPECT_FALSE(p.trainable) << p.name;
    experts += model::is_fused_expert_tensor(p.name) ? 1 : 0;
  }
  EXPECT_GT(experts, 0);
  EXPECT_EQ(int64_t(plan.frozen.size()), experts + 1);
  EXPECT_FALSE(plan.vision_tower);
}

TEST(Freeze, PatternsThatCannotBeHonouredAreErrorsNamingTheKey) {
  {
    model::ParamStore store = load_tiny();
    const std::string e = test::message_of(
        [&] { train::apply_freeze(store, {"no_such_tensor"}, "r.toml: train.freeze"); });
    EXPECT_NE(e.find("matches no parameter"), std::string::npos) << e;
    EXPECT_NE(e.find("r.toml: train.freeze"), std::string::npos) << e;
  }
  {
    // One expert of a layer: the layer's experts are one fused tensor.
    model::ParamStore store = load_tiny();
    const std::string e = test::message_of(
        [&] { train::apply_freeze(store, {"mlp\\.experts\\.0\\."}, "r.toml: train.freeze"); });
    EXPECT_NE(e.find("one fused tensor"), std::string::npos) << e;
    EXPECT_NE(e.find("experts.0."), std::string::npos) << e;
  }
  {
    // q's conv weight only: q, k, v conv weights are one fused tensor.
    model::ParamStore store = load_tiny();
    const std::string e =
        test::message_of([&] { train::apply_freeze(store, {"q_conv1d"}, "r.toml: train.freeze"); });
    EXPECT_NE(e.find("k_conv1d"), std::string::npos) << e;
  }
  {
    model::ParamStore store = load_tiny();
    const std::string e = test::message_of([&] {
      train::apply_freeze(store, {"model\\.visual\\.blocks\\.0\\."}, "r.toml: train.freeze");
    });
    if (std::any_of(store.params().begin(), store.params().end(),
                    [](const auto& p) { return p.name.starts_with("model.visual."); }))
      EXPECT_NE(e.find("vision tower"), std::string::npos) << e;
  }
  {
    model::ParamStore store = load_tiny();
    const std::string e =
        test::message_of([&] { train::apply_freeze(store, {"("}, "r.toml: train.freeze"); });
    EXPECT_NE(e.find("not a regular expression"), std::string::npos) << e;
  }
}

TEST(Freeze, RecipeReadsWritesAndFingerprintsThePatterns) {
  const std::string base =
      "[model]\npath = \"m\"\n[data]\nfiles = [\"d.jsonl\"]\n[output]\ndir = "
      "\"o\"\n[train]\ntotal_steps = 2\n";
  const train::Recipe plain = train::Recipe::parse(base, "plain");
  const train::Recipe frozen = train::Recipe::parse(
      base + "freeze = [\"mlp\\\\.experts\\\\.\", 'embed_tokens']\n", "frozen");
  ASSERT_EQ(frozen.freeze.size(), 2u);
  EXPECT_EQ(frozen.freeze[0], "mlp\\.experts\\.");
  EXPECT_EQ(frozen.freeze[1], "embed_tokens");
  EXPECT_NE(plain.fingerprint(1), frozen.fingerprint(1));
  const train::Recipe again = train::Recipe::parse(frozen.to_toml(), "written");
  EXPECT_EQ(again.freeze, frozen.freeze);
  EXPECT_EQ(again.fingerprint(1), frozen.fingerprint(1));
  const std::string bad = test::message_of(
      [&] { train::Recipe::parse(base + "freeze = [\"[unclosed\"]\n", "bad.toml"); });
  EXPECT_NE(bad.find("not a regular expression"), std::string::npos) << bad;
  EXPECT_NE(bad.find("bad.toml"), std::string::npos) << bad;
  const std::string not_array =
      test::message_of([&] { train::Recipe::parse(base + "freeze = \"experts\"\n", "bad.toml"); });
  EXPECT_NE(not_array.find("freeze"), std::string::npos) << not_array;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }

// Freezing one parameter of every kind the backward handles removes exactly those gradients: every
// other gradient, the input-embedding gradient and the objective are bit-identical to the run
// without freezing (the frozen weights still shape the forward and the input gradients).
TEST(Freeze, FrozenParametersGetNoGradientAndTheRestIsUnchanged) {
  const std::vector<std::string> patterns = {kExperts,
                                             "self_attn\\.[qkv]_conv1d",
                                             "layers\\.0\\.hc_attn_",
                                             "embed_tokens",
                                             "lm_head",
                                             "layers\\.[0-9]+\\.mlp\\.gate\\.weight",
                                             "shared_experts\\.down_proj",
                                             "kv_b_proj",
                                             "o_norm",
                                             "layers\\.1\\.input_layernorm",
                                             "q_a_layernorm",
                                             "dt_bias",
                                             "A_log",
                                             "f_b_proj",
                                             "eh_proj"};
  model::ParamStore all = load_tiny();
  model::ParamStore some = load_tiny();
  const train::FreezePlan plan = train::apply_freeze(some, patterns, "test");
  const model::text::TextModel full(all), frozen(some);
  const model::TextConfig& c = full.text();

  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(1, int32_t(c.vocab_size) - 1);
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(tok(rng));
  model::text::PackInput in;
  in.input_ids = i32(ids);
  in.cu_seqlens = i32({0, 23, 40});
  std::vector<int32_t> labels(ids.begin() + 1, ids.end());
  labels.push_back(-100);
  labels[22] = -100;
  in.labels = i32(labels);
  model::text::TrainOptions opt;
  opt.balancing_alpha = 0.001;
  opt.mtp = full.has_mtp();
  opt.mtp_depths = opt.mtp ? c.num_nextn_predict_layers : 0;
  opt.mtp_loss_scale = 0.1;

  model::text::TextGrads g_all = model::text::TextGrads::zeros_like(full.weights());
  model::text::TextGrads g_some = model::text::TextGrads::zeros_like(frozen.weights());
  const model::text::StepPackResult r_all = forward_backward(full, in, opt, g_all);
  const model::text::StepPackResult r_some = forward_backward(frozen, in, opt, g_some);
  EXPECT_EQ(r_all.backward.objective(), r_some.backward.objective());
  EXPECT_TRUE(same_bits(r_all.backward.d_embeddings, r_some.backward.d_embeddings));

  const std::set<std::string> frozen_names(plan.frozen.begin(), plan.frozen.end());
  std::map<std::string, Tensor> kept;
  for (const auto& [name, g] : g_some.named) kept[name] = g;
  int64_t compared = 0;
  for (const auto& [name, g] : g_all.named) {
    if (frozen_names.count(name)) {
      EXPECT_EQ(kept.count(name), 0u) << name << " is frozen but has a gradient buffer";
      continue;
    }
    ASSERT_EQ(kept.count(name), 1u) << name;
    EXPECT_TRUE(same_bits(g, kept[name])) << name;
    ++compared;
  }
  EXPECT_GT(compared, 10);
  // Every frozen tensor had a gradient in the unfrozen run.
  for (const std::string& name : plan.frozen)
    EXPECT_TRUE(std::any_of(g_all.named.begin(), g_all.named.end(), [&](const auto& n) {
      return n.first == name;
    })) << name;
  EXPECT_GE(plan.frozen.size(), patterns.size());
  // The backward allocated nothing for them either: the struct fields stay without a buffer.
  for (const model::text::LayerGrads& l : g_some.layers) {
    EXPECT_FALSE(l.moe.gate_up_proj.weight.defined());
    EXPECT_FALSE(l.moe.down_proj.weight.defined());
    EXPECT_FALSE(l.kda.conv1d.defined());
    EXPECT_FALSE(l.moe.router_weight.defined());
  }
  EXPECT_FALSE(g_some.embed_tokens.defined());
  EXPECT_FALSE(g_some.lm_head.defined());
}

// ---- Training runs ----------------------------------------------------------------------------

std::string recipe_text(const fs::path& out, const std::string& train_lines) {
  std::ostringstream s;
  s << "[model]\npath = \"" << tiny_model().string() << "\"\n"
    << "tokenizer = \"" << (kSource / "examples/tiny/tokenizer").string() << "\"\n"
    << "[data]\nfiles = [\"" << (kSource / "examples/tiny/data/chat.jsonl").string() << "\"]\n"
    << "format = \"chat\"\nmax_length = 192\npack_max_length = 192\n"
    << "[train]\ntotal_steps = 3\nmicro_packs = 2\nseed = 3\n"
    << train_lines << "[optimizer]\nlr = 3e-3\nlr_min = 3e-4\nwarmup_steps = 1\n"
    << "[output]\ndir = \"" << out.string() << "\"\nsave_every = 3\nkeep_last = 0\nlog_every = 1\n";
  return s.str();
}

// Three steps with the routed experts frozen, with whole decoder layers and with fsdp.
TEST(Freeze, FrozenExpertsStayByteIdenticalAndHaveNoOptimizerState) {
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  for (const std::string fsdp : {"false", "true"}) {
    SCOPED_TRACE("fsdp = " + fsdp);
    TempDir dir("freeze-run");
    const train::TrainSummary s = train::run_training(
        train::Recipe::parse(
            recipe_text(dir.path() / "out",
                        "fsdp = " + fsdp + "\nfreeze = [\"mlp\\\\.experts\\\\.\"]\n"),
            "freeze recipe"),
        quiet);
    ASSERT_EQ(s.steps.size(), 3u);
    test::expect_frozen_experts(tiny_model(),
                                dir.path() / "out" / train::kCheckpointsDir / "step-3");
  }
}

// The tiny model of tiny_model() written in the FP8 release's layout (init --fp8) under `dir`.
fs::path write_fp8_tiny(const fs::path& dir) {
  const fs::path path = dir / "fp8";
  model::InitOptions options;
  options.seed = 5;
  options.fp8 = true;
  model::write_random_checkpoint(model::ModelConfig::preset("tiny"), path, options);
  return path;
}

// recipe_text's run on `model` with the routed experts frozen and more [train] `lines`.
train::Recipe frozen_experts_recipe(const fs::path& model, const fs::path& out,
                                    const std::string& lines) {
  std::string text = recipe_text(out, "freeze = [\"mlp\\\\.experts\\\\.\"]\n" + lines);
  const std::string bf16_path = "path = \"" + tiny_model().string() + "\"";
  text.replace(text.find(bf16_path), bf16_path.size(), "path = \"" + model.string() + "\"");
  return train::Recipe::parse(text, out.filename().string() + ".toml");
}

// Two runs of three steps, step for step the same loss and gradient norm, bit for bit.
void expect_same_steps(const train::TrainSummary& a, const train::TrainSummary& b) {
  ASSERT_EQ(a.steps.size(), 3u);
  ASSERT_EQ(b.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(&a.steps[i].loss, &b.steps[i].loss, sizeof(double)), 0)
        << "step " << i + 1;
    EXPECT_EQ(std::memcmp(&a.steps[i].grad_norm, &b.steps[i].grad_norm, sizeof(double)), 0)
        << "step " << i + 1;
  }
}

// train.frozen_weights = "fp8" on an FP8 checkpoint (the release's layout, init --fp8): the frozen
// routed experts stay in FP8 and are dequantised per layer around each use, the FP8 tensors the
// run trains (dense MLPs, shared experts, MLA projections) are read whole; the values are the
// bf16 load's, so every step equals the run that dequantises at load, bit for bit, and the model
// it saves (the frozen experts read back from the file) is the same bytes. A run resumed from that
// checkpoint (bf16 throughout) holds the experts as stored and goes on as the uninterrupted run.
TEST(Freeze, FrozenFp8ExpertsHeldInFp8TrainAsTheDequantisedLoad) {
  TempDir dir("freeze-fp8");
  const fs::path fp8_model = write_fp8_tiny(dir.path());
  const auto recipe = [&](const std::string& out, const std::string& lines) {
    return frozen_experts_recipe(fp8_model, dir.path() / out, lines);
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary bf16 = train::run_training(recipe("bf16", ""), quiet);
  const train::TrainSummary held =
      train::run_training(recipe("held", "frozen_weights = \"fp8\"\n"), quiet);
  ASSERT_NO_FATAL_FAILURE(expect_same_steps(held, bf16));
  const fs::path model_dir = fs::path(train::kCheckpointsDir) / "step-3" / "model";
  for (const auto& entry : fs::directory_iterator(dir.path() / "bf16" / model_dir))
    if (entry.path().extension() == ".safetensors")
      EXPECT_EQ(test::read_text(entry.path()),
                test::read_text(dir.path() / "held" / model_dir / entry.path().filename()))
          << entry.path().filename();

  // Stopped at step 2 and resumed from its checkpoint (bf16 throughout): step 3 as the run above.
  std::atomic<bool> stop{false};
  train::TrainerOptions first = quiet;
  first.stop = &stop;
  first.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 2) stop = true;
  };
  const train::Recipe again = recipe("resumed", "frozen_weights = \"fp8\"\n");
  EXPECT_TRUE(train::run_training(again, first).interrupted);
  train::TrainerOptions resuming = quiet;
  resuming.resume = true;
  const train::TrainSummary rest = train::run_training(again, resuming);
  ASSERT_EQ(rest.steps.size(), 1u);
  EXPECT_EQ(std::memcmp(&rest.steps[0].loss, &held.steps[2].loss, sizeof(double)), 0);
}

// train.fp8 = "tilewise" beside frozen FP8 experts: the FP8 GEMMs read the released codes and
// scales of each expert whose pieces make one 128 × 128 grid (tiny: down_proj, one piece of 64
// rows per expert; not gate_up_proj, two pieces of 32 rows that would share a block), pinned to
// the expert's slice while its layer is gathered and dropped with it. The checkpoint was quantised
// by the same rule from bf16 values, so quantising its dequantised values again gives back its
// codes: the run equals the run that loads the experts in bf16 and quantises them, bit for bit.
// down_proj, read by the FP8 GEMMs alone, is gathered as a shape without values (never
// dequantised): the run computes without them.
TEST(Freeze, FrozenFp8ExpertsFeedTheFp8GemmsTheirCodes) {
  TempDir dir("freeze-fp8-gemms");
  const fs::path fp8_model = write_fp8_tiny(dir.path());
  const model::ModelConfig config = model::ModelConfig::preset("tiny");

  const io::CheckpointReader reader = io::CheckpointReader::open(fp8_model);
  const int64_t num_layers = config.text().num_hidden_layers;
  model::ParamStore store =
      model::ParamStore::load(reader, config, std::nullopt, [&](const std::string& name) {
        return model::text::stored_in_fp8(reader, name, num_layers);
      });
  (void)train::apply_freeze(store, {kExperts}, "test");
  for (const model::InternalParam& p : store.params())
    if (p.deferred && p.trainable) store.load_deferred(reader, p.name);
  model::text::TextModel model(store, model::text::TextModelOptions{});
  model::text::use_fp8_gemms(model.weights(), 0);
  model::text::Fp8Layers held(model.weights(), store, reader, /*feed_fp8_gemms=*/true);
  const int64_t experts = config.text().n_routed_experts;
  const std::vector<model::MlpKind>& kinds = config.text().mlp_layer_types;
  const int64_t moe_layers = std::count(kinds.begin(), kinds.end(), model::MlpKind::sparse) +
                             config.text().num_nextn_predict_layers;  // the MTP layer's MoE
  EXPECT_EQ(held.tensors(), 2 * moe_layers);
  EXPECT_EQ(held.fed_weights(), experts * moe_layers);
  // down_proj is read by the FP8 GEMMs alone: it is never dequantised (gate_up_proj, fed no
  // codes, is).
  EXPECT_EQ(held.codes_only_tensors(), moe_layers);

  const int64_t layer = num_layers - 1;
  const int64_t pins = ops::fp8_weight_counts().pinned;
  held.gather(layer);
  {  // the test lets go of the field before the release
    const Tensor down = model.weights().layers[size_t(layer)].moe.down_proj.weight;
    EXPECT_EQ(ops::fp8_weight_counts().pinned, pins + experts);
    EXPECT_EQ(down.data_ptr(), nullptr);
    EXPECT_NE(model.weights().layers[size_t(layer)].moe.gate_up_proj.weight.data_ptr(), nullptr);
    const std::string prefix = fmt::format("model.language_model.layers.{}.mlp.experts.", layer);
    for (int64_t e = 0; e < experts; ++e) {
      const ops::Fp8Blocks b = ops::fp8_weight_blocks(down.select(0, e));
      // The held codes each time (no scope is open: a weight not pinned is quantised afresh).
      EXPECT_EQ(ops::fp8_weight_blocks(down.select(0, e)).values.storage(), b.values.storage());
      const std::string name = fmt::format("{}{}.down_proj.weight", prefix, e);
      EXPECT_EQ(bytes_of(b.values), bytes_of(reader.tensor(name))) << name;
      EXPECT_EQ(bytes_of(b.scales), bytes_of(reader.tensor(io::fp8_scale_name(name)))) << name;
    }
  }
  held.release(layer);
  EXPECT_EQ(ops::fp8_weight_counts().pinned, pins);

  const auto recipe = [&](const std::string& out, const std::string& lines) {
    return frozen_experts_recipe(fp8_model, dir.path() / out, "fp8 = \"tilewise\"\n" + lines);
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary requantised = train::run_training(recipe("bf16", ""), quiet);
  const train::TrainSummary fed =
      train::run_training(recipe("held", "frozen_weights = \"fp8\"\n"), quiet);
  expect_same_steps(fed, requantised);
}

// The optimizer state of a checkpoint holds the parameters its run trained: resuming with other
// freeze patterns is refused, and the fix names train.freeze.
TEST(Freeze, ResumingWithOtherPatternsNamesTrainFreeze) {
  TempDir dir("freeze-resume");
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  train::run_training(train::Recipe::parse(recipe_text(dir.path() / "out", ""), "plain.toml"),
                      quiet);
  train::TrainerOptions resuming = quiet;
  resuming.resume = true;
  const std::string e = test::message_of([&] {
    train::run_training(
        train::Recipe::parse(recipe_text(dir.path() / "out", "freeze = ['mlp\\.experts\\.']\n"),
                             "frozen.toml"),
        resuming);
  });
  EXPECT_NE(e.find("optimizer state does not match"), std::string::npos) << e;
  EXPECT_NE(e.find("train.freeze"), std::string::npos) << e;
}

TEST(Freeze, FreezingEverythingIsAnError) {
  TempDir dir("freeze-all");
  const std::string e = test::message_of([&] {
    train::run_training(
        train::Recipe::parse(recipe_text(dir.path() / "out", "freeze = [\".\"]\n"), "all.toml"));
  });
  EXPECT_NE(e.find("no parameter to train"), std::string::npos) << e;
  EXPECT_NE(e.find("all.toml"), std::string::npos) << e;
}

}  // namespace

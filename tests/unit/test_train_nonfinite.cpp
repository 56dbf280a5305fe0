// Non-finite steps: a NaN gradient or a non-finite loss is reported with the step and the
// offending tensors (released names) in the log line and metrics.jsonl; the recipe's
// train.on_nonfinite skips the update or stops the run; no checkpoint ever holds non-finite
// weights.

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/config.h"
#include "glmtune/model/init.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer.h"
#include "support/temp_dir.h"

using namespace glmtune;
namespace fs = std::filesystem;
using glmtune::test::TempDir;

namespace {

const fs::path kSource = GLMTUNE_SOURCE_DIR;

const fs::path& tiny_model() {
  static TempDir dir("nonfinite-model");
  static const fs::path path = [] {
    model::InitOptions options;
    options.seed = 3;
    model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", options);
    return dir / "tiny";
  }();
  return path;
}

train::Recipe recipe(const fs::path& model, const fs::path& out, int64_t steps,
                     const std::string& policy, int64_t save_every) {
  std::ostringstream s;
  s << "[model]\npath = \"" << model.string() << "\"\ntokenizer = \""
    << (kSource / "examples/tiny/tokenizer").string() << "\"\n"
    << "[data]\nfiles = [\"" << (kSource / "examples/tiny/data/chat.jsonl").string() << "\"]\n"
    << "format = \"chat\"\nmax_length = 128\npack_max_length = 128\n"
    << "[train]\ntotal_steps = " << steps << "\nmicro_packs = 1\nseed = 5\non_nonfinite = \""
    << policy << "\"\n"
    << "[optimizer]\nlr = 1e-3\n"
    << "[output]\ndir = \"" << out.string() << "\"\nsave_every = " << save_every
    << "\nkeep_last = 0\n";
  return train::Recipe::parse(s.str(), "test recipe");
}

std::vector<nlohmann::json> read_metrics(const fs::path& out) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(out / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

// The first MoE layer's fused gate/up tensor: NaN written into expert 1's up rows names the
// released tensor experts.1.up_proj.weight.
struct Injection {
  std::string internal, released;
};
Injection expert_up_injection() {
  const model::ModelConfig config = model::ModelConfig::preset("tiny");
  const auto& types = config.text().mlp_layer_types;
  for (size_t l = 0; l < types.size(); ++l)
    if (types[l] == model::MlpKind::sparse) {
      const std::string prefix =
          "model.language_model.layers." + std::to_string(l) + ".mlp.experts.";
      return {prefix + "gate_up_proj", prefix + "1.up_proj.weight"};
    }
  ADD_FAILURE() << "the tiny preset has no MoE layer";
  return {};
}

train::TrainerOptions inject_at(int64_t bad_step, const Injection& inj) {
  train::TrainerOptions options;
  options.print_steps = false;
  options.on_gradients = [=](int64_t step, const auto& grad) {
    if (step != bad_step) return;
    Tensor& g = grad(inj.internal);
    const int64_t I = g.size(1) / 2;
    Tensor row = g.select(0, 1).select(0, I + 3);
    row.copy_(Tensor::full(row.shape(), std::numeric_limits<double>::quiet_NaN(), row.dtype()));
  };
  return options;
}

// Copies a checkpoint with one element of `name` set to +inf.
void poisoned_copy(const fs::path& from, const fs::path& to, const std::string& name) {
  const io::CheckpointReader reader = io::CheckpointReader::open(from);
  io::CheckpointWriter writer(to);
  for (const std::string& n : reader.names()) {
    Tensor t = reader.tensor(n).to(DType::f32).contiguous().clone();
    if (n == name) t.data<float>()[0] = std::numeric_limits<float>::infinity();
    writer.add(n, t);
  }
  writer.copy_file(from / "config.json", "config.json");
  writer.finish();
}

}  // namespace

TEST(TrainNonFinite, SkipNamesTheReleasedTensorAndGoesOn) {
  TempDir dir("nonfinite-skip");
  const Injection inj = expert_up_injection();
  const train::TrainSummary s =
      train::run_training(recipe(tiny_model(), dir / "out", 4, "skip", 0), inject_at(2, inj));
  ASSERT_EQ(s.steps.size(), 4u);
  EXPECT_EQ(s.skipped_steps, 1);
  for (const train::StepMetrics& m : s.steps) {
    EXPECT_EQ(m.skipped, m.step == 2) << m.step;
    if (m.step != 2) {
      EXPECT_TRUE(m.nonfinite.empty());
      EXPECT_TRUE(std::isfinite(m.grad_norm));
      continue;
    }
    EXPECT_EQ(m.nonfinite, std::vector<std::string>{inj.released});
    EXPECT_TRUE(std::isfinite(m.loss)) << "the loss of the step itself was finite";
    const std::string line = m.log_line();
    EXPECT_NE(line.find("step 2/4"), std::string::npos) << line;
    EXPECT_NE(line.find(inj.released), std::string::npos) << line;
  }
  const auto metrics = read_metrics(dir / "out");
  ASSERT_EQ(metrics.size(), 4u);
  EXPECT_EQ(metrics[1]["step"], 2);
  EXPECT_EQ(metrics[1]["skipped"], true);
  EXPECT_EQ(metrics[1]["nonfinite"], nlohmann::json::array({inj.released}));
  EXPECT_TRUE(metrics[1]["grad_norm"].is_null());
  EXPECT_EQ(metrics[2]["nonfinite"], nlohmann::json::array());
  EXPECT_FALSE(s.checkpoint.empty()) << "the run went on to its final checkpoint";
}

TEST(TrainNonFinite, StopNamesTheStepAndSavesNothingOfIt) {
  TempDir dir("nonfinite-stop");
  const Injection inj = expert_up_injection();
  try {
    train::run_training(recipe(tiny_model(), dir / "out", 5, "stop", 1), inject_at(3, inj));
    FAIL() << "the run did not stop";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("step 3"), std::string::npos) << e.what();
    EXPECT_NE(e.problem().find(inj.released), std::string::npos) << e.what();
    EXPECT_NE(e.where().find("train.on_nonfinite"), std::string::npos) << e.what();
  }
  EXPECT_EQ(train::complete_checkpoint_steps(dir / "out"), (std::vector<int64_t>{1, 2}));
  const auto metrics = read_metrics(dir / "out");
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_EQ(metrics[2]["skipped"], true);
  EXPECT_EQ(metrics[2]["nonfinite"], nlohmann::json::array({inj.released}));
}

TEST(TrainNonFinite, PoisonedWeightsAreNeverSaved) {
  TempDir dir("nonfinite-weights");
  // An infinite head weight makes the logits, and so the loss, non-finite without touching the
  // routing of the forward.
  const std::string bad = "lm_head.weight";
  poisoned_copy(tiny_model(), dir / "poisoned", bad);

  // Stop: the first step's loss is not finite; nothing is saved.
  try {
    train::TrainerOptions quiet;
    quiet.print_steps = false;
    train::run_training(recipe(dir / "poisoned", dir / "stop", 3, "stop", 1), quiet);
    FAIL() << "the run did not stop";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("step 1"), std::string::npos) << e.what();
    EXPECT_NE(e.problem().find("loss"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(train::complete_checkpoint_steps(dir / "stop").empty());
  const auto stop_metrics = read_metrics(dir / "stop");
  ASSERT_EQ(stop_metrics.size(), 1u);
  EXPECT_EQ(stop_metrics[0]["nonfinite"][0], "loss");

  // Skip: every step is skipped, and the final save refuses the non-finite weights, naming them.
  try {
    train::TrainerOptions quiet;
    quiet.print_steps = false;
    train::run_training(recipe(dir / "poisoned", dir / "skip", 2, "skip", 1), quiet);
    FAIL() << "non-finite weights were saved";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("not saving step 1"), std::string::npos) << e.what();
    EXPECT_NE(e.problem().find(bad), std::string::npos) << e.what();
  }
  EXPECT_TRUE(train::complete_checkpoint_steps(dir / "skip").empty());
  EXPECT_FALSE(fs::exists(dir / "skip" / "checkpoints" / "step-1"));
}

TEST(TrainNonFinite, RecipeKey) {
  const fs::path model = tiny_model();
  EXPECT_EQ(recipe(model, "out", 1, "stop", 0).on_nonfinite, train::NonFinitePolicy::kStop);
  EXPECT_EQ(recipe(model, "out", 1, "skip", 0).on_nonfinite, train::NonFinitePolicy::kSkip);
  EXPECT_NE(recipe(model, "out", 1, "stop", 0).to_toml().find("on_nonfinite = \"stop\""),
            std::string::npos);
  try {
    recipe(model, "out", 1, "ignore", 0);
    FAIL() << "accepted on_nonfinite = \"ignore\"";
  } catch (const Error& e) {
    EXPECT_NE(e.where().find("train.on_nonfinite"), std::string::npos) << e.what();
    EXPECT_NE(e.fix().find("skip or stop"), std::string::npos) << e.what();
  }
}

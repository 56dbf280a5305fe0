// `glmtune train` on the GPU against the same run on the CPU: 50 steps of the tiny model (with the
// geometry the GPU kernels take) on the bundled chat data, same recipe, same data order; the GPU
// run's loss must follow the CPU run's within bf16 tolerance at every step (the model:
// support/gpu_tiny_model.h). Skipped where no GPU is visible. The repository root is taken from
// GLMTUNE_SOURCE_DIR when set (tests/gpu/run.sh sets it on the GPU machine), else from the build.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/model/init.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/trainer.h"
#include "support/cuda_test_support.h"
#include "support/gpu_tiny_model.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::test;
namespace fs = std::filesystem;

namespace {

#ifdef GLMTUNE_WITH_CUDA
fs::path source_dir() {
  const char* env = std::getenv("GLMTUNE_SOURCE_DIR");
  return env ? fs::path(env) : fs::path(GLMTUNE_SOURCE_DIR);
}

std::string recipe_text(const fs::path& model, const fs::path& out, const std::string& device) {
  const fs::path src = source_dir();
  std::ostringstream s;
  s << "[model]\npath = \"" << model.string() << "\"\n"
    << "tokenizer = \"" << (src / "examples/tiny/tokenizer").string() << "\"\n"
    << "[data]\nfiles = [\"" << (src / "examples/tiny/data/chat.jsonl").string() << "\"]\n"
    << "format = \"chat\"\nmax_length = 192\npack_max_length = 192\n"
    << "[train]\ntotal_steps = 50\nmicro_packs = 2\nseed = " << test_seed() % 1000
    << "\ndevice = \"" << device << "\"\n"
    << "[optimizer]\nlr = 3e-3\nlr_min = 3e-4\nwarmup_steps = 2\n"
    << "[loss]\nmtp_scale = 0.1\nbalancing_alpha = 0.001\nrouter_bias_update_rate = 0.001\n"
    << "[output]\ndir = \"" << out.string()
    << "\"\nsave_every = 0\nkeep_last = 0\nlog_every = 10\n";
  return s.str();
}
#endif

TEST(CudaTrain, FiftyStepsFollowTheCpuLossCurve) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train");
  const model::ModelConfig config = gpu_tiny_config();
  model::InitOptions init;
  init.seed = test_seed();
  model::write_random_checkpoint(config, dir.path() / "model", init);

  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary cpu = train::run_training(
      train::Recipe::parse(recipe_text(dir.path() / "model", dir.path() / "cpu", "cpu"), "cpu"),
      quiet);
  const train::TrainSummary gpu = train::run_training(
      train::Recipe::parse(recipe_text(dir.path() / "model", dir.path() / "gpu", "cuda:0"), "gpu"),
      quiet);

  ASSERT_EQ(cpu.steps.size(), 50u);
  ASSERT_EQ(gpu.steps.size(), 50u);
  double worst = 0;
  for (size_t i = 0; i < cpu.steps.size(); ++i) {
    const double want = cpu.steps[i].loss, got = gpu.steps[i].loss;
    const double rel = std::abs(got - want) / want;
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 2e-2) << ctx("step " + std::to_string(i + 1) + ": cpu " + std::to_string(want) +
                                " gpu " + std::to_string(got));
    EXPECT_FALSE(gpu.steps[i].skipped) << "step " << i + 1;
  }
  std::printf("[ measure  ] loss cpu %.4f -> %.4f, gpu %.4f -> %.4f; worst step rel diff %.2e\n",
              cpu.steps.front().loss, cpu.steps.back().loss, gpu.steps.front().loss,
              gpu.steps.back().loss, worst);
  // Training did something: the loss fell on both devices.
  EXPECT_LT(gpu.steps.back().loss, 0.8 * gpu.steps.front().loss);
#endif
}

}  // namespace

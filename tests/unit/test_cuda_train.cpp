// `glmtune train` on the GPU against the same run on the CPU: 50 steps of the tiny model (with the
// geometry the GPU kernels take) on the bundled chat data, same recipe, same data order; the GPU
// run's loss must follow the CPU run's within bf16 tolerance at every step (the model:
// support/gpu_tiny_model.h). Skipped where no GPU is visible. The repository root is taken from
// GLMTUNE_SOURCE_DIR when set (tests/gpu/run.sh sets it on the GPU machine), else from the build.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/lora.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer.h"
#include "support/cuda_test_support.h"
#include "support/frozen_experts.h"
#include "support/gpu_tiny_model.h"
#include "support/temp_dir.h"
#include "support/tiny_vl_data.h"

using namespace glmtune;
using namespace glmtune::test;
namespace fs = std::filesystem;

namespace {

#ifdef GLMTUNE_WITH_CUDA
fs::path source_dir() {
  const char* env = std::getenv("GLMTUNE_SOURCE_DIR");
  return env ? fs::path(env) : fs::path(GLMTUNE_SOURCE_DIR);
}

// A random tiny model with the GPU kernels' geometry (support/gpu_tiny_model.h) at `path`.
// `fp8`: in the FP8 release's layout (model/init.h).
void write_gpu_tiny_model(const fs::path& path, bool fp8 = false) {
  model::InitOptions init;
  init.seed = test_seed();
  init.fp8 = fp8;
  model::write_random_checkpoint(gpu_tiny_config(), path, init);
}

// `train_lines`: more [train] keys, one per line.
std::string recipe_text(const fs::path& model, const fs::path& out, const std::string& device,
                        int total_steps = 50, const std::string& train_lines = "") {
  const fs::path src = source_dir();
  std::ostringstream s;
  s << "[model]\npath = \"" << model.string() << "\"\n"
    << "tokenizer = \"" << (src / "examples/tiny/tokenizer").string() << "\"\n"
    << "[data]\nfiles = [\"" << (src / "examples/tiny/data/chat.jsonl").string() << "\"]\n"
    << "format = \"chat\"\nmax_length = 192\npack_max_length = 192\n"
    << "[train]\ntotal_steps = " << total_steps
    << "\nmicro_packs = 2\nseed = " << test_seed() % 1000 << "\ndevice = \"" << device << "\"\n"
    << train_lines << "[optimizer]\nlr = 3e-3\nlr_min = 3e-4\nwarmup_steps = 2\n"
    << "[loss]\nmtp_scale = 0.1\nbalancing_alpha = 0.001\nrouter_bias_update_rate = 0.001\n"
    << "[output]\ndir = \"" << out.string()
    << "\"\nsave_every = 0\nkeep_last = 0\nlog_every = 10\n";
  return s.str();
}

// The GPU run's loss at every step within 2e-2 (relative) of the CPU run's, no step skipped; the
// measured worst gap and both curves' ends are printed under `label`.
void expect_follows_cpu(const train::TrainSummary& cpu, const train::TrainSummary& gpu,
                        size_t steps, const char* label) {
  ASSERT_EQ(cpu.steps.size(), steps);
  ASSERT_EQ(gpu.steps.size(), steps);
  double worst = 0;
  for (size_t i = 0; i < steps; ++i) {
    const double want = cpu.steps[i].loss, got = gpu.steps[i].loss;
    const double rel = std::abs(got - want) / want;
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 2e-2) << ctx("step " + std::to_string(i + 1) + ": cpu " + std::to_string(want) +
                                " gpu " + std::to_string(got));
    EXPECT_FALSE(gpu.steps[i].skipped) << "step " << i + 1;
  }
  std::printf(
      "[ measure  ] %s: loss cpu %.4f -> %.4f, gpu %.4f -> %.4f; worst step rel diff %.2e\n", label,
      cpu.steps.front().loss, cpu.steps.back().loss, gpu.steps.front().loss, gpu.steps.back().loss,
      worst);
}

// The recipe's CPU run and GPU run, `steps` steps each; `sections` come after the recipe's own
// ([lora] and the like).
std::pair<train::TrainSummary, train::TrainSummary> cpu_and_gpu_runs(const fs::path& model,
                                                                     const fs::path& dir, int steps,
                                                                     const std::string& train_lines,
                                                                     const std::string& sections) {
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const auto run = [&](const std::string& device) {
    return train::run_training(
        train::Recipe::parse(
            recipe_text(model, dir / device.substr(0, 3), device, steps, train_lines) + sections,
            device),
        quiet);
  };
  train::TrainSummary cpu = run("cpu");
  return {std::move(cpu), run("cuda:0")};
}
#endif

TEST(CudaTrain, FiftyStepsFollowTheCpuLossCurve) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train");
  write_gpu_tiny_model(dir.path() / "model");

  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary cpu = train::run_training(
      train::Recipe::parse(recipe_text(dir.path() / "model", dir.path() / "cpu", "cpu"), "cpu"),
      quiet);
  const train::TrainSummary gpu = train::run_training(
      train::Recipe::parse(recipe_text(dir.path() / "model", dir.path() / "gpu", "cuda:0"), "gpu"),
      quiet);

  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, 50, "text"));
  // Training did something: the loss fell on both devices.
  EXPECT_LT(gpu.steps.back().loss, 0.8 * gpu.steps.front().loss);
#endif
}

#ifdef GLMTUNE_WITH_CUDA
// A vision-language recipe on the bundled tiny-vl conversations (images, and the video where the
// build decodes videos); `device` and `total_steps` as for text.
std::string vl_recipe_text(const fs::path& model, const fs::path& data, const fs::path& out,
                           const std::string& device, int total_steps, int pack = 2048) {
  const fs::path src = source_dir();
  std::ostringstream s;
  s << "[model]\npath = \"" << model.string() << "\"\n"
    << "tokenizer = \"" << (src / "examples/tiny/tokenizer").string() << "\"\n"
    << "[data]\nfiles = [\"" << data.string() << "\"]\n"
    << "media_root = \"" << (src / "examples/tiny-vl").string() << "\"\n"
    << "max_length = " << pack << "\npack_max_length = " << pack << "\n"
    << "[train]\ntotal_steps = " << total_steps << "\nseed = " << test_seed() % 1000
    << "\ndevice = \"" << device << "\"\n"
    << "[optimizer]\nlr = 3e-3\nlr_min = 3e-4\nwarmup_steps = 2\n"
    << "[loss]\nmtp_scale = 0.1\nbalancing_alpha = 0.001\nrouter_bias_update_rate = 0.001\n"
    << "[output]\ndir = \"" << out.string()
    << "\"\nsave_every = 0\nkeep_last = 0\nlog_every = 10\n";
  return s.str();
}
#endif

// Vision-language training on one GPU: the tower and the projector run there and the device
// optimizer updates them in place beside the text model. The loss follows the CPU run of the same
// recipe, the tower's and projector's weights move as on the CPU, and a run stopped at step 3
// resumes on the GPU bit for bit.
TEST(CudaTrain, VisionLanguageRunFollowsTheCpuAndResumesExactly) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-vl");
  write_gpu_tiny_model(dir.path() / "model");
  const fs::path data = tiny_vl_chat(source_dir(), dir.path());
  const auto recipe = [&](const fs::path& out, const std::string& device, int steps) {
    return train::Recipe::parse(vl_recipe_text(dir.path() / "model", data, out, device, steps),
                                device);
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary cpu = train::run_training(recipe(dir.path() / "cpu", "cpu", 6), quiet);
  const train::TrainSummary gpu =
      train::run_training(recipe(dir.path() / "gpu", "cuda:0", 6), quiet);
  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, 6, "VL"));

  // The checkpoints: every vision tensor moved from the initial weights on the GPU, and the
  // updates of all of them together are the CPU run's within what six Adam steps from gradients
  // 1e-2 apart leave (a sign flips where a gradient is near zero) and the bf16 rounding of the
  // stored weights (a whole unit in the last place of a norm weight near 1 is 40% of its update).
  ASSERT_FALSE(cpu.checkpoint.empty());
  ASSERT_FALSE(gpu.checkpoint.empty());
  const io::CheckpointReader init = io::CheckpointReader::open(dir.path() / "model");
  const io::CheckpointReader after_cpu = io::CheckpointReader::open(cpu.checkpoint / "model");
  const io::CheckpointReader after_gpu = io::CheckpointReader::open(gpu.checkpoint / "model");
  int vision_tensors = 0;
  std::vector<double> update_cpu, update_gpu;
  for (const std::string& name : init.names()) {
    if (!name.starts_with("model.visual.")) continue;
    ++vision_tensors;
    const std::vector<double> w0 = init.tensor(name).to_doubles(),
                              wc = after_cpu.tensor(name).to_doubles(),
                              wg = after_gpu.tensor(name).to_doubles();
    double moved = 0;
    for (size_t i = 0; i < w0.size(); ++i) {
      update_cpu.push_back(wc[i] - w0[i]);
      update_gpu.push_back(wg[i] - w0[i]);
      moved = std::max(moved, std::abs(wg[i] - w0[i]));
    }
    EXPECT_GT(moved, 0.0) << name << " did not move on the GPU";
  }
  EXPECT_CLOSE(update_gpu, update_cpu, 0.2, "every vision weight's update together");
  EXPECT_GT(vision_tensors, 20);

  // Stopped at step 3 and resumed on the GPU: steps 4-6 exactly as the uninterrupted run.
  std::atomic<bool> stop{false};
  train::TrainerOptions stopping = quiet;
  stopping.stop = &stop;
  stopping.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 3) stop = true;
  };
  const train::TrainSummary first =
      train::run_training(recipe(dir.path() / "resumed", "cuda:0", 6), stopping);
  ASSERT_TRUE(first.interrupted);
  train::TrainerOptions resuming = quiet;
  resuming.resume = true;
  const train::TrainSummary rest =
      train::run_training(recipe(dir.path() / "resumed", "cuda:0", 6), resuming);
  ASSERT_EQ(rest.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(rest.steps[i].loss, gpu.steps[3 + i].loss) << "step " << 4 + i;
    EXPECT_EQ(rest.steps[i].grad_norm, gpu.steps[3 + i].grad_norm) << "step " << 4 + i;
  }
#endif
}

// Fifty vision-language steps on the GPU follow the CPU's loss curve within the text run's bar:
// the tower's and projector's bf16 arithmetic does not drift the run off the reference.
TEST(CudaTrain, FiftyVisionLanguageStepsFollowTheCpuLossCurve) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-vl50");
  write_gpu_tiny_model(dir.path() / "model");
  const fs::path data = tiny_vl_chat(source_dir(), dir.path());
  const auto recipe = [&](const fs::path& out, const std::string& device) {
    // Packs of 512 tokens (the four conversations hold 364): the CPU run's time is the point.
    return train::Recipe::parse(vl_recipe_text(dir.path() / "model", data, out, device, 50, 512),
                                device);
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary cpu = train::run_training(recipe(dir.path() / "cpu", "cpu"), quiet);
  const train::TrainSummary gpu = train::run_training(recipe(dir.path() / "gpu", "cuda:0"), quiet);
  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, 50, "50 VL steps"));
  EXPECT_LT(gpu.steps.back().loss, 0.8 * gpu.steps.front().loss);
#endif
}

// The optimizer of a one-GPU run lives on the device (train/device_adamw.h) and saves the host
// optimizer's format: a run stopped at step 3 and resumed on the GPU continues bit for bit as the
// uninterrupted run does (the masters, moments and step count come back exactly), and the same
// checkpoint resumed on the CPU follows within bf16 tolerance.
TEST(CudaTrain, StoppedOnTheGpuResumesOnTheGpuExactlyAndOnTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-resume");
  write_gpu_tiny_model(dir.path() / "model");
  const auto recipe = [&](const fs::path& out, const std::string& device) {
    return train::Recipe::parse(recipe_text(dir.path() / "model", out, device, 6), device);
  };

  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary straight =
      train::run_training(recipe(dir.path() / "a", "cuda:0"), quiet);
  ASSERT_EQ(straight.steps.size(), 6u);

  std::atomic<bool> stop{false};
  train::TrainerOptions stopping = quiet;
  stopping.stop = &stop;
  stopping.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 3) stop = true;
  };
  const train::TrainSummary first =
      train::run_training(recipe(dir.path() / "b", "cuda:0"), stopping);
  ASSERT_TRUE(first.interrupted);
  ASSERT_EQ(first.end_step, 3);
  fs::copy(dir.path() / "b", dir.path() / "c", fs::copy_options::recursive);

  train::TrainerOptions resuming = quiet;
  resuming.resume = true;
  const train::TrainSummary gpu = train::run_training(recipe(dir.path() / "b", "cuda:0"), resuming);
  const train::TrainSummary cpu = train::run_training(recipe(dir.path() / "c", "cpu"), resuming);
  ASSERT_EQ(gpu.steps.size(), 3u);
  ASSERT_EQ(cpu.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const train::StepMetrics& want = straight.steps[3 + i];
    EXPECT_EQ(gpu.steps[i].loss, want.loss) << "step " << want.step << " resumed on the GPU";
    EXPECT_EQ(gpu.steps[i].grad_norm, want.grad_norm) << "step " << want.step;
    const double rel = std::abs(cpu.steps[i].loss - want.loss) / want.loss;
    EXPECT_LE(rel, 2e-2) << "step " << want.step << " resumed on the CPU: " << cpu.steps[i].loss
                         << " against " << want.loss;
  }
  std::printf(
      "[ measure  ] steps 4-6 straight %.6f %.6f %.6f, resumed on the GPU %.6f %.6f %.6f, "
      "on the CPU %.6f %.6f %.6f\n",
      straight.steps[3].loss, straight.steps[4].loss, straight.steps[5].loss, gpu.steps[0].loss,
      gpu.steps[1].loss, gpu.steps[2].loss, cpu.steps[0].loss, cpu.steps[1].loss,
      cpu.steps[2].loss);
#endif
}

// A non-finite gradient on the GPU skips the whole update (the device optimizer's clip becomes
// NaN), names the tensor, and the run goes on.
TEST(CudaTrain, NonFiniteGradientSkipsTheGpuStepAndNamesTheTensor) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-nonfinite");
  write_gpu_tiny_model(dir.path() / "model");
  train::TrainerOptions options;
  options.print_steps = false;
  options.on_gradients = [](int64_t step, const std::function<Tensor&(const std::string&)>& grad) {
    if (step == 2) grad("model.language_model.norm.weight").fill_(std::nan(""));
  };
  const train::TrainSummary run = train::run_training(
      train::Recipe::parse(recipe_text(dir.path() / "model", dir.path() / "out", "cuda:0", 4),
                           "gpu"),
      options);
  ASSERT_EQ(run.steps.size(), 4u);
  EXPECT_FALSE(run.steps[0].skipped);
  EXPECT_TRUE(run.steps[1].skipped);
  EXPECT_FALSE(run.steps[2].skipped);
  EXPECT_EQ(run.skipped_steps, 1);
  const std::vector<std::string>& named = run.steps[1].nonfinite;
  EXPECT_NE(std::find(named.begin(), named.end(), "model.language_model.norm.weight"), named.end())
      << "named: " << ::testing::PrintToString(named);
  for (const train::StepMetrics& m : run.steps) EXPECT_TRUE(std::isfinite(m.loss));
#endif
}

// Fully sharded decoder layers on one GPU (train.fsdp without a launcher: a group of one, the
// layers gathered and their gradients reduced around every use, the layer optimizer's state on the
// device) follow the unsharded GPU run, and their checkpoint, in the released layout, resumes
// without fsdp. Several GPUs: tests/gpu/dist_check.sh.
TEST(CudaTrain, FullyShardedLayersOnOneGpuFollowTheWholeRunAndResumeWithout) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-fsdp-train");
  write_gpu_tiny_model(dir.path() / "model");
  const auto recipe = [&](const fs::path& out, const std::string& train_lines) {
    return train::Recipe::parse(recipe_text(dir.path() / "model", out, "cuda:0", 6, train_lines),
                                "gpu");
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary whole = train::run_training(recipe(dir.path() / "whole", ""), quiet);
  ASSERT_EQ(whole.steps.size(), 6u);

  std::atomic<bool> stop{false};
  train::TrainerOptions stopping = quiet;
  stopping.stop = &stop;
  stopping.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 3) stop = true;
  };
  const train::TrainSummary sharded =
      train::run_training(recipe(dir.path() / "fsdp", "fsdp = true\n"), stopping);
  ASSERT_TRUE(sharded.interrupted);
  ASSERT_EQ(sharded.steps.size(), 3u);
  train::TrainerOptions resuming = quiet;
  resuming.resume = true;
  const train::TrainSummary resumed =
      train::run_training(recipe(dir.path() / "fsdp", ""), resuming);
  ASSERT_EQ(resumed.steps.size(), 3u);

  // The same kernels on the same weights, and the same AdamW arithmetic: equal on the H200 (worst
  // 0 when this was written); the bar leaves room for a master one f32 bit away rounding to the
  // neighbouring bf16 value, should the norm's sum ever be ordered otherwise.
  double worst = 0;
  for (size_t i = 0; i < 6; ++i) {
    const train::StepMetrics& got = i < 3 ? sharded.steps[i] : resumed.steps[i - 3];
    const double want = whole.steps[i].loss;
    const double rel = std::abs(got.loss - want) / want;
    worst = std::max(worst, rel);
    EXPECT_LE(rel, i == 0 ? 1e-6 : 1e-4)
        << "step " << i + 1 << (i < 3 ? " (fsdp)" : " (resumed without fsdp)") << ": " << got.loss
        << " against " << want;
    EXPECT_FALSE(got.skipped) << "step " << i + 1;
  }
  std::printf(
      "[ measure  ] losses whole %.6f .. %.6f, fsdp then resumed without %.6f .. %.6f; worst step "
      "rel diff %.2e\n",
      whole.steps.front().loss, whole.steps.back().loss, sharded.steps.front().loss,
      resumed.steps.back().loss, worst);
#endif
}

// train.freeze on the GPU, whole layers and fully sharded ones: the frozen routed experts leave
// the checkpoint byte-identical to the initial one, every other trained tensor moves, and the
// optimizer state holds nothing of them.
TEST(CudaTrain, FrozenExpertsStayByteIdenticalWholeAndSharded) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-freeze");
  write_gpu_tiny_model(dir.path() / "model");
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  for (const std::string fsdp : {"false", "true"}) {
    SCOPED_TRACE("fsdp = " + fsdp);
    const fs::path out = dir.path() / ("out-" + fsdp);
    const train::TrainSummary s = train::run_training(
        train::Recipe::parse(recipe_text(dir.path() / "model", out, "cuda:0", 3,
                                         "fsdp = " + fsdp + "\nfreeze = ['mlp\\.experts\\.']\n"),
                             "gpu freeze"),
        quiet);
    ASSERT_EQ(s.steps.size(), 3u);
    const test::FrozenExpertsCheck c =
        test::expect_frozen_experts(dir.path() / "model", out / train::kCheckpointsDir / "step-3");
    std::printf(
        "[ measure  ] fsdp = %s: %ld frozen expert tensors unchanged, %ld of %ld others "
        "changed, %ld optimizer tensors\n",
        fsdp.c_str(), long(c.experts), long(c.changed), long(c.others), long(c.optimizer));
  }
#endif
}

// LoRA on one GPU: adapters of rank 8 on every projection, the base frozen (bf16 on the device,
// no gradients, no optimizer state), the adapters' f32 masters and moments on the device. The
// loss follows the CPU run of the same recipe, the adapters move as on the CPU, the checkpoint
// holds the adapter (PEFT's layout) and no copy of the base, and a run stopped at step 3 resumes
// bit for bit.
TEST(CudaTrain, LoraRunFollowsTheCpuAndResumesExactly) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-lora");
  write_gpu_tiny_model(dir.path() / "model");
  constexpr int kSteps = 20;
  const std::string lora_section =
      "[lora]\nrank = 8\nalpha = 16\ntarget_modules = [\"all-linear\"]\n"
      "target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n";
  const auto recipe = [&](const fs::path& out, const std::string& device, int steps,
                          const std::string& train_lines = "") {
    return train::Recipe::parse(
        recipe_text(dir.path() / "model", out, device, steps, train_lines) + lora_section,
        device + " lora");
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary cpu =
      train::run_training(recipe(dir.path() / "cpu", "cpu", kSteps), quiet);
  const train::TrainSummary gpu =
      train::run_training(recipe(dir.path() / "gpu", "cuda:0", kSteps), quiet);
  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, kSteps, "LoRA"));
  EXPECT_LT(gpu.steps.back().loss, gpu.steps.front().loss);

  // The checkpoints: an adapter and no base. The adapters' updates (from PEFT's start, drawn from
  // train.seed, redrawn here) together within what twenty Adam steps from gradients a few percent
  // apart leave (a sign flips where a gradient is near zero), and every adapter tensor moved.
  ASSERT_FALSE(gpu.checkpoint.empty());
  EXPECT_FALSE(fs::exists(gpu.checkpoint / "model"));
  model::ParamStore start =
      model::ParamStore::load(io::CheckpointReader::open(dir.path() / "model"), gpu_tiny_config());
  const train::Recipe r = recipe(dir.path() / "cpu", "cpu", kSteps);
  model::add_lora_adapters(start, *r.lora, model::resolve_lora_targets(start, *r.lora, "test"),
                           r.seed);
  const auto trained = [&](const fs::path& checkpoint) {
    model::ParamStore s = model::ParamStore::load(io::CheckpointReader::open(dir.path() / "model"),
                                                  gpu_tiny_config());
    model::load_lora_adapter(s, checkpoint / "adapter");
    return s;
  };
  const model::ParamStore after_cpu = trained(cpu.checkpoint), after_gpu = trained(gpu.checkpoint);
  std::vector<double> update_cpu, update_gpu;
  int64_t adapters = 0;
  for (const model::InternalParam& p : start.params()) {
    if (!p.adapter) continue;
    ++adapters;
    const std::vector<double> w0 = p.value.to_doubles(), wc = after_cpu.get(p.name).to_doubles(),
                              wg = after_gpu.get(p.name).to_doubles();
    double moved = 0;
    for (size_t i = 0; i < w0.size(); ++i) {
      update_cpu.push_back(wc[i] - w0[i]);
      update_gpu.push_back(wg[i] - w0[i]);
      moved = std::max(moved, std::abs(wg[i] - w0[i]));
    }
    EXPECT_GT(moved, 0.0) << p.name << " did not move on the GPU";
  }
  EXPECT_GT(adapters, 40);
  const double update_rel = rel_l2(update_gpu, update_cpu);
  EXPECT_LE(update_rel, 0.2) << ctx("every adapter's update together");
  std::printf("[ measure  ] %ld adapter tensors; their updates gpu vs cpu rel L2 %.2e\n",
              long(adapters), update_rel);

  // Stopped at step 3 and resumed: steps 4-6 exactly as the uninterrupted run.
  const train::TrainSummary straight =
      train::run_training(recipe(dir.path() / "straight", "cuda:0", 6), quiet);
  std::atomic<bool> stop{false};
  train::TrainerOptions stopping = quiet;
  stopping.stop = &stop;
  stopping.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 3) stop = true;
  };
  ASSERT_TRUE(
      train::run_training(recipe(dir.path() / "resumed", "cuda:0", 6), stopping).interrupted);
  train::TrainerOptions resuming = quiet;
  resuming.resume = true;
  const train::TrainSummary rest =
      train::run_training(recipe(dir.path() / "resumed", "cuda:0", 6), resuming);
  ASSERT_EQ(rest.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(rest.steps[i].loss, straight.steps[3 + i].loss) << "step " << 4 + i;
    EXPECT_EQ(rest.steps[i].grad_norm, straight.steps[3 + i].grad_norm) << "step " << 4 + i;
  }

  // Fully sharded layers with adapters on a GPU are refused before any work, naming the key.
  try {
    train::run_training(recipe(dir.path() / "fsdp", "cuda:0", 6, "fsdp = true\n"), quiet);
    ADD_FAILURE() << "train.fsdp with [lora] on a GPU was accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.where().find("train.fsdp"), std::string::npos) << e.what();
  }
#endif
}

// LoRA on an FP8 checkpoint with lora.base = "fp8": the base's FP8 weights (experts, dense MLP,
// MLA projections, of the decoder layers and the MTP layer) stay on the GPU as e4m3 codes and block
// scales and are dequantised per layer around each use. The values computed with are those of the
// bf16 load, so every step equals the run with lora.base = "bf16" bit for bit.
TEST(CudaTrain, LoraOnAnFp8BaseEqualsTheDequantisedBase) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-fp8-base");
  write_gpu_tiny_model(dir.path() / "model", /*fp8=*/true);
  const auto recipe = [&](const std::string& base) {
    return train::Recipe::parse(
        recipe_text(dir.path() / "model", dir.path() / base, "cuda:0", 8, "recompute = 0.5\n") +
            "[lora]\nrank = 8\nalpha = 16\ntarget_modules = [\"all-linear\"]\n"
            "target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n"
            "base = \"" +
            base + "\"\n",
        base);
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary bf16 = train::run_training(recipe("bf16"), quiet);
  const train::TrainSummary fp8 = train::run_training(recipe("fp8"), quiet);
  ASSERT_EQ(fp8.steps.size(), bf16.steps.size());
  for (size_t i = 0; i < bf16.steps.size(); ++i) {
    EXPECT_EQ(fp8.steps[i].loss, bf16.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(fp8.steps[i].grad_norm, bf16.steps[i].grad_norm) << "step " << i + 1;
  }
#endif
}

// LoRA with dropout on a GPU: the masks are the CPU's (counter-based draws keyed by seed, step,
// pack and module), so the run follows the CPU run of the same recipe; kv_b_proj's adapter with
// dropout takes the per-head attention (its masked input does not merge into the weight).
TEST(CudaTrain, LoraDropoutRunFollowsTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-lora-dropout");
  write_gpu_tiny_model(dir.path() / "model");
  constexpr int kSteps = 10;
  const auto [cpu, gpu] = cpu_and_gpu_runs(
      dir.path() / "model", dir.path(), kSteps, "",
      "[lora]\nrank = 8\nalpha = 16\ntarget_modules = [\"all-linear\"]\ndropout = 0.1\n");
  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, kSteps, "LoRA dropout"));
#endif
}

// train.fp8 = "tilewise" on a GPU: cuBLASLt's block-scaled e4m3 GEMMs on the quantisers' codes
// follow the CPU run of the same recipe, whose GEMMs take the same quantised operands in f32; the
// bf16 run of the same call is printed beside it (FP8 moves the curve, within a few percent).
TEST(CudaTrain, Fp8TilewiseRunFollowsTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-fp8");
  write_gpu_tiny_model(dir.path() / "model");
  constexpr int kSteps = 20;
  const auto recipe = [&](const std::string& device, const std::string& out, bool fp8) {
    return train::Recipe::parse(recipe_text(dir.path() / "model", dir.path() / out, device, kSteps,
                                            fp8 ? "fp8 = \"tilewise\"\n" : ""),
                                out);
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary cpu = train::run_training(recipe("cpu", "cpu", true), quiet);
  const train::TrainSummary gpu = train::run_training(recipe("cuda:0", "gpu", true), quiet);
  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, kSteps, "fp8 tilewise"));
  const train::TrainSummary bf16 = train::run_training(recipe("cuda:0", "bf16", false), quiet);
  ASSERT_EQ(bf16.steps.size(), size_t(kSteps));
  double worst = 0;
  for (size_t i = 0; i < kSteps; ++i)
    worst = std::max(worst, std::abs(gpu.steps[i].loss - bf16.steps[i].loss) / bf16.steps[i].loss);
  std::printf(
      "[ measure  ] fp8 vs bf16 on the GPU: loss %.4f -> %.4f vs %.4f -> %.4f; worst "
      "step rel gap %.2e\n",
      gpu.steps.front().loss, gpu.steps.back().loss, bf16.steps.front().loss,
      bf16.steps.back().loss, worst);
  EXPECT_LE(worst, 5e-2);
#endif
}

// LoRA beside the FP8 GEMMs: adapters on every projection and every routed expert stay in bf16
// while their base weights' products run in FP8 (the fused MoE kernels' per-expert FP8 GEMMs with
// the expert adapters' grouped GEMMs beside them); the GPU run follows the CPU run of the recipe.
TEST(CudaTrain, LoraBesideFp8GemmsFollowsTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-lora-fp8");
  write_gpu_tiny_model(dir.path() / "model");
  constexpr int kSteps = 10;
  const auto [cpu, gpu] = cpu_and_gpu_runs(
      dir.path() / "model", dir.path(), kSteps, "fp8 = \"tilewise\"\n",
      "[lora]\nrank = 8\nalpha = 16\ntarget_modules = [\"all-linear\"]\n"
      "target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n");
  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, kSteps, "LoRA beside FP8 GEMMs"));
#endif
}

// Frozen FP8 weights beside the FP8 GEMMs, in full fine-tuning (train.frozen_weights = "fp8" with
// the experts frozen) and under LoRA (lora.base = "fp8"): the GEMMs of the weights whose pieces
// make one block grid read the released codes, on the GPU in its scale layout with the codes
// shared, and the other FP8 weights are quantised from their values; the GPU run follows the CPU.
TEST(CudaTrain, FrozenFp8WeightsFeedingTheFp8GemmsFollowTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-train-fp8-fed");
  write_gpu_tiny_model(dir.path() / "model", /*fp8=*/true);
  constexpr int kSteps = 10;
  {
    const auto [cpu, gpu] = cpu_and_gpu_runs(
        dir.path() / "model", dir.path() / "full", kSteps,
        "fp8 = \"tilewise\"\nfreeze = [\"mlp\\\\.experts\\\\.\"]\nfrozen_weights = \"fp8\"\n", "");
    ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, kSteps, "frozen FP8 experts, FP8 GEMMs"));
  }
  const auto [cpu, gpu] = cpu_and_gpu_runs(
      dir.path() / "model", dir.path() / "lora", kSteps, "fp8 = \"tilewise\"\n",
      "[lora]\nrank = 8\nalpha = 16\ntarget_modules = [\"all-linear\"]\nbase = \"fp8\"\n");
  ASSERT_NO_FATAL_FAILURE(expect_follows_cpu(cpu, gpu, kSteps, "LoRA on an FP8 base, FP8 GEMMs"));
#endif
}

}  // namespace

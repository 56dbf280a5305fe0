// `glmtune eval --device cuda` (eval/evaluate.h) against the CPU reference evaluation of the same
// checkpoint and data: the tiny model with the GPU kernels' geometry (support/gpu_tiny_model.h) on
// the bundled chat data, packed as training packs it. The GPU runs bf16 weights and compute with
// fp32 accumulation, so its numbers are held to the bars of the bf16 path (docs/testing.md, "Parity
// measures"): loss within 1e-2 relative, logits within 1e-2 relative L2. What a GPU evaluation
// refuses (gradients, a GPU that is not there) is checked on every machine.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/eval/evaluate.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/init.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/param_store.h"
#include "support/cuda_test_support.h"
#include "support/gpu_tiny_model.h"
#include "support/temp_dir.h"
#include "support/tiny_vl_data.h"

using namespace glmtune;
using namespace glmtune::test;
namespace fs = std::filesystem;

namespace {

fs::path source_dir() {
  const char* env = std::getenv("GLMTUNE_SOURCE_DIR");
  return env ? fs::path(env) : fs::path(GLMTUNE_SOURCE_DIR);
}

eval::EvalOptions chat_eval(const fs::path& model, const std::string& device) {
  eval::EvalOptions o;
  o.model = model.string();
  o.tokenizer = (source_dir() / "examples/tiny/tokenizer").string();
  o.data = {(source_dir() / "examples/tiny/data/chat.jsonl").string()};
  o.pack_length = 192;
  o.max_packs = 6;
  o.device = Device::parse(device);
  return o;
}

double logits_rel_l2(const Tensor& got, const Tensor& want) {
  const Tensor g = got.to(DType::f64).contiguous(), w = want.to(DType::f64).contiguous();
  double num = 0, den = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double d = g.data<double>()[i] - w.data<double>()[i];
    num += d * d;
    den += w.data<double>()[i] * w.data<double>()[i];
  }
  return std::sqrt(num / den);
}

// The largest relative L2 distance between the samples' logits dumped to DIR/gpu.safetensors and
// DIR/cpu.safetensors, each checked against `bar`.
double worst_logits_error(const fs::path& dir, size_t samples, double bar) {
  const io::SafetensorsFile cpu = io::SafetensorsFile::open((dir / "cpu.safetensors").string());
  const io::SafetensorsFile gpu = io::SafetensorsFile::open((dir / "gpu.safetensors").string());
  double worst = 0;
  for (size_t i = 0; i < samples; ++i) {
    const std::string name = "logits." + std::to_string(i);
    const double rel = logits_rel_l2(gpu.tensor(name), cpu.tensor(name));
    worst = std::max(worst, rel);
    EXPECT_LE(rel, bar) << ctx(name);
  }
  return worst;
}

std::string error_of(const eval::EvalOptions& o) {
  try {
    eval::evaluate(o);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(CudaEval, GpuEvaluationFollowsTheCpuReference) {
  REQUIRE_GPU();
  TempDir dir("cuda-eval");
  model::InitOptions init;
  init.seed = test_seed();
  model::write_random_checkpoint(gpu_tiny_config(), dir.path() / "model", init);

  eval::EvalOptions cpu_options = chat_eval(dir.path() / "model", "cpu");
  eval::EvalOptions gpu_options = chat_eval(dir.path() / "model", "cuda:0");
  cpu_options.dump_logits = (dir.path() / "cpu.safetensors").string();
  gpu_options.dump_logits = (dir.path() / "gpu.safetensors").string();
  const eval::EvalResult cpu = eval::evaluate(cpu_options);
  const eval::EvalResult gpu = eval::evaluate(gpu_options);

  EXPECT_EQ(gpu.device, Device::cuda(0));
  ASSERT_EQ(gpu.per_sample.size(), cpu.per_sample.size());
  EXPECT_EQ(gpu.tokens, cpu.tokens);
  EXPECT_EQ(gpu.packs, cpu.packs);
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-2 * cpu.loss) << ctx("loss");
  ASSERT_TRUE(cpu.mtp_loss && gpu.mtp_loss);
  EXPECT_NEAR(*gpu.mtp_loss, *cpu.mtp_loss, 1e-2 * *cpu.mtp_loss) << ctx("mtp loss");
  double worst_sample = 0;
  for (size_t i = 0; i < cpu.per_sample.size(); ++i) {
    ASSERT_EQ(gpu.per_sample[i].tokens, cpu.per_sample[i].tokens) << i;
    if (!cpu.per_sample[i].loss) continue;
    const double rel =
        std::abs(*gpu.per_sample[i].loss - *cpu.per_sample[i].loss) / *cpu.per_sample[i].loss;
    worst_sample = std::max(worst_sample, rel);
    EXPECT_LE(rel, 2e-2) << ctx("sample " + std::to_string(i));
  }

  const double worst_logits = worst_logits_error(dir.path(), cpu.per_sample.size(), 1e-2);
  std::printf(
      "[ measure  ] loss cpu %.6f gpu %.6f (rel %.2e); worst sample rel %.2e; worst logits "
      "rel-L2 %.2e\n",
      cpu.loss, gpu.loss, std::abs(gpu.loss - cpu.loss) / cpu.loss, worst_sample, worst_logits);
}

// The same for vision-language data: the bundled examples/tiny-vl conversations (real images, and
// a short video where this build decodes videos) with the vision tower and the splice on the GPU
// too.
TEST(CudaEval, GpuVisionLanguageEvaluationFollowsTheCpuReference) {
  REQUIRE_GPU();
  TempDir dir("cuda-eval-vl");
  model::InitOptions init;
  init.seed = test_seed();
  model::write_random_checkpoint(gpu_tiny_config(), dir.path() / "model", init);
  eval::EvalOptions cpu_options = chat_eval(dir.path() / "model", "cpu");
  cpu_options.data = {tiny_vl_chat(source_dir(), dir.path()).string()};
  cpu_options.media_root = (source_dir() / "examples/tiny-vl").string();
  cpu_options.pack_length = 2048;
  cpu_options.max_packs = 0;
  eval::EvalOptions gpu_options = cpu_options;
  gpu_options.device = Device::cuda(0);
  cpu_options.dump_logits = (dir.path() / "cpu.safetensors").string();
  gpu_options.dump_logits = (dir.path() / "gpu.safetensors").string();
  const eval::EvalResult cpu = eval::evaluate(cpu_options);
  const eval::EvalResult gpu = eval::evaluate(gpu_options);

  EXPECT_EQ(gpu.device, Device::cuda(0));
  ASSERT_EQ(gpu.per_sample.size(), cpu.per_sample.size());
  EXPECT_EQ(gpu.tokens, cpu.tokens);
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-2 * cpu.loss) << ctx("loss");
  // The text path's 1e-2, plus the media rows' features: the bf16 tower and projector put
  // about 1e-2 relative on them (test_cuda_vision: pooler output 8e-3 .. 9e-3).
  const double worst_logits = worst_logits_error(dir.path(), cpu.per_sample.size(), 3e-2);
  std::printf(
      "[ measure  ] VL loss cpu %.6f gpu %.6f (rel %.2e) over %zu samples; worst logits "
      "rel-L2 %.2e\n",
      cpu.loss, gpu.loss, std::abs(gpu.loss - cpu.loss) / cpu.loss, cpu.per_sample.size(),
      worst_logits);
}

// `glmtune eval --adapter` on the GPU: a PEFT adapter (rank 8 on every projection, A and B drawn
// nonzero, f32 as PEFT saves it) applied to the bf16 base there, against the CPU evaluation with
// the same adapter, within the text path's bars. The adapter moves every sample's logits by at
// least five times that bar (an adapter that dwarfs its weights, moving the logits by more than
// their own size, measured 3e-2 at one seed: the bf16 error grows with the activations).
TEST(CudaEval, GpuEvaluationWithAnAdapterFollowsTheCpu) {
  REQUIRE_GPU();
  TempDir dir("cuda-eval-lora");
  model::InitOptions init;
  init.seed = test_seed();
  model::write_random_checkpoint(gpu_tiny_config(), dir.path() / "model", init);
  {
    model::ParamStore store = model::ParamStore::load(
        io::CheckpointReader::open(dir.path() / "model"), gpu_tiny_config());
    model::LoraConfig lora;
    lora.rank = 8;
    lora.alpha = 16;
    lora.target_modules = {"all-linear"};
    model::add_lora_adapters(store, lora, model::resolve_lora_targets(store, lora, "test"),
                             test_seed());
    std::mt19937_64 rng(test_seed() + 3);
    std::normal_distribution<double> n(0.0, 1.0);
    for (const model::InternalParam& p : store.params()) {
      if (!p.adapter || !p.name.ends_with(".lora_B.weight")) continue;
      std::vector<double> v(size_t(p.value.numel()));
      for (double& x : v) x = 0.05 / std::sqrt(double(p.value.size(-1))) * n(rng);
      store.get(p.name) = Tensor::from_doubles(v, p.value.shape(), DType::f32);
    }
    model::save_lora_adapter(store, lora, dir.path() / "adapter");
  }
  eval::EvalOptions cpu_options = chat_eval(dir.path() / "model", "cpu");
  cpu_options.dump_logits = (dir.path() / "base.safetensors").string();
  const eval::EvalResult base = eval::evaluate(cpu_options);
  cpu_options.adapter = (dir.path() / "adapter").string();
  eval::EvalOptions gpu_options = cpu_options;
  gpu_options.device = Device::cuda(0);
  cpu_options.dump_logits = (dir.path() / "cpu.safetensors").string();
  gpu_options.dump_logits = (dir.path() / "gpu.safetensors").string();
  const eval::EvalResult cpu = eval::evaluate(cpu_options);
  const eval::EvalResult gpu = eval::evaluate(gpu_options);

  EXPECT_EQ(gpu.device, Device::cuda(0));
  ASSERT_EQ(gpu.per_sample.size(), cpu.per_sample.size());
  // The adapter moves every sample's logits far beyond the bar the GPU is held to.
  const io::SafetensorsFile base_logits =
      io::SafetensorsFile::open((dir.path() / "base.safetensors").string());
  const io::SafetensorsFile cpu_logits =
      io::SafetensorsFile::open((dir.path() / "cpu.safetensors").string());
  double least_moved = 1e300;
  for (size_t i = 0; i < cpu.per_sample.size(); ++i) {
    const std::string name = "logits." + std::to_string(i);
    least_moved =
        std::min(least_moved, logits_rel_l2(base_logits.tensor(name), cpu_logits.tensor(name)));
  }
  EXPECT_GT(least_moved, 5e-2) << "the adapter barely changes the logits";
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-2 * cpu.loss) << ctx("loss");
  const double worst_logits = worst_logits_error(dir.path(), cpu.per_sample.size(), 1e-2);
  std::printf(
      "[ measure  ] adapter: loss base %.6f, with the adapter cpu %.6f gpu %.6f (rel %.2e); "
      "worst logits rel-L2 %.2e; the adapter moves the logits by at least %.2e\n",
      base.loss, cpu.loss, gpu.loss, std::abs(gpu.loss - cpu.loss) / cpu.loss, worst_logits,
      least_moved);
}

// Refused before anything is read, on any machine: a GPU that is not visible (or a build without
// CUDA), and gradients on a GPU.
TEST(CudaEval, RefusesWhatAGpuEvaluationCannotDo) {
  TempDir dir("cuda-eval-refusals");
  eval::EvalOptions o = chat_eval(dir.path() / "missing-model", "cuda:63");
  const std::string missing = error_of(o);
  EXPECT_NE(missing.find("--device"), std::string::npos) << missing;
  EXPECT_NE(missing.find("cuda:63"), std::string::npos) << missing;
#ifdef GLMTUNE_WITH_CUDA
  if (cuda_available()) {
    o.device = Device::cuda(0);
    o.dump_grads = (dir.path() / "grads.safetensors").string();
    const std::string grads = error_of(o);
    EXPECT_NE(grads.find("--dump-grads runs on the CPU only"), std::string::npos) << grads;
    EXPECT_FALSE(fs::exists(o.dump_grads));
  }
#endif
}

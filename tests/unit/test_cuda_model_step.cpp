// The whole text training step on the GPU against the same step on the CPU: forward, loss, and the
// gradient of every trainable parameter, for one pack of several documents with MTP and the
// balancing loss on. The model is gpu_tiny_config() (support/gpu_tiny_model.h); every parameter is
// drawn fresh (seed printed) and rounded to bf16, so both devices see the same values and only the
// arithmetic differs (bf16 storage with fp32 accumulation on the GPU, f32 on the CPU). Skipped
// where no GPU is visible.

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "support/cuda_test_support.h"
#include "support/gpu_tiny_model.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::model;
using namespace glmtune::model::text;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA

// Every parameter redrawn around the scale its kind needs (norm weights near 1, small router
// bias, ...), rounded to bf16.
void redraw(ParamStore& store, std::mt19937_64& rng) {
  std::normal_distribution<double> n(0.0, 1.0);
  for (const InternalParam& p : store.params()) {
    const std::string& name = p.name;
    double mean = 0, sd = 0.05;
    if (name.ends_with("e_score_correction_bias"))
      sd = 0.05;
    else if (name.ends_with("_base") || name.ends_with("A_log"))
      sd = 0.5;
    else if (name.ends_with("_scale"))
      mean = 1.0, sd = 0.3;
    else if (name.find("norm") != std::string::npos && name.ends_with("weight"))
      mean = 1.0, sd = 0.2;
    else if (p.value.dim() >= 2)
      sd = 1.0 / std::sqrt(double(p.value.size(-1)));
    std::vector<double> v(size_t(p.value.numel()));
    for (double& x : v) x = mean + sd * n(rng);
    store.get(name) =
        Tensor::from_doubles(v, p.value.shape(), DType::f32).to(DType::bf16).to(DType::f32);
  }
}
#endif

TEST(CudaModelStep, LossAndEveryGradientMatchTheCpuStep) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const ModelConfig config = gpu_tiny_config();
  TempDir dir("cuda-step");
  InitOptions init;
  init.seed = test_seed();
  write_random_checkpoint(config, dir.path() / "ck", init);
  ParamStore store = ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
  std::mt19937_64 rng(test_seed());
  redraw(store, rng);

  const TextModel cpu(store);
  TextModelOptions gpu_options;
  gpu_options.dtype = DType::bf16;
  gpu_options.device = kGpu;
  const TextModel gpu(store, gpu_options);

  // Three documents (lengths 1, 70 and 57) and a padding document of 8.
  const std::vector<int32_t> cu_values = {0, 1, 71, 128, 136};
  const int64_t tokens = cu_values.back();
  std::uniform_int_distribution<int32_t> token(1, int32_t(config.text().vocab_size) - 1);
  std::vector<int32_t> ids(static_cast<size_t>(tokens)), labels(static_cast<size_t>(tokens), -100);
  for (int32_t& id : ids) id = token(rng);
  for (size_t d = 0; d + 2 < cu_values.size(); ++d)
    for (int32_t i = cu_values[d]; i + 1 < cu_values[d + 1]; ++i)
      labels[size_t(i)] = ids[size_t(i + 1)];
  PackInput in;
  in.input_ids = Tensor::from_vector(ids, {tokens});
  in.cu_seqlens = Tensor::from_vector(cu_values, {int64_t(cu_values.size())});
  in.labels = Tensor::from_vector(labels, {tokens});
  in.padding_tokens = 8;

  TrainOptions opt;
  opt.balancing_alpha = 0.01;
  TextGrads cpu_grads = TextGrads::zeros_like(cpu.weights());
  TextGrads gpu_grads = TextGrads::zeros_like(gpu.weights());
  const StepPackResult rc = forward_backward(cpu, in, opt, cpu_grads);
  const StepPackResult rg = forward_backward(gpu, in, opt, gpu_grads);

  std::printf("[ measure  ] loss cpu %.6f gpu %.6f; mtp cpu %.6f gpu %.6f\n", rc.backward.lm_loss,
              rg.backward.lm_loss, rc.backward.mtp_loss, rg.backward.mtp_loss);
  EXPECT_EQ(rg.backward.lm_tokens, rc.backward.lm_tokens);
  EXPECT_NEAR(rg.backward.lm_loss, rc.backward.lm_loss, 2e-3 * rc.backward.lm_loss) << ctx("loss");
  EXPECT_NEAR(rg.backward.mtp_loss, rc.backward.mtp_loss, 2e-3 * rc.backward.mtp_loss + 1e-6)
      << ctx("MTP loss");
  EXPECT_NEAR(rg.backward.balancing_loss, rc.backward.balancing_loss,
              2e-2 * std::abs(rc.backward.balancing_loss) + 1e-7)
      << ctx("balancing loss");
  ASSERT_EQ(rg.loads.size(), rc.loads.size());
  for (size_t r = 0; r < rc.loads.size(); ++r)
    EXPECT_TRUE(bit_identical(rg.loads[r].counts, rc.loads[r].counts)) << rc.loads[r].bias_name;

  // Gradients: every activation of the GPU step is rounded to bf16 and the backward of five
  // layers (20 Sinkhorn iterations per mHC site among them) compounds those roundings, so the
  // gradients land several percent from the f32 step: on the H200 (2026-11-29) 1.5e-2 .. 8.6e-2
  // per tensor and 5e-2 .. 7.4e-2 for all of them together over two seeds, against 1e-3 .. 1e-2
  // for a single op (test_cuda_dispatch, test_cuda_ops_*). The bars: all gradients together
  // within 1e-1, each tensor of at least 1024 elements within 1.5e-1. Small tensors (mHC base and
  // scale, A_log: a few to a few hundred sums over all tokens, where cancellation makes the
  // relative error meaningless) are printed and held by the global bar; their op-level tests hold
  // them tightly.
  ASSERT_EQ(gpu_grads.named.size(), cpu_grads.named.size());
  std::vector<double> all_got, all_want;
  for (size_t i = 0; i < cpu_grads.named.size(); ++i) {
    const auto& [name, want] = cpu_grads.named[i];
    ASSERT_EQ(gpu_grads.named[i].first, name);
    const Tensor& got = gpu_grads.named[i].second;
    EXPECT_EQ(got.device(), kGpu) << name;
    const std::vector<double> g = got.to(Device::cpu()).to_doubles(), w = want.to_doubles();
    all_got.insert(all_got.end(), g.begin(), g.end());
    all_want.insert(all_want.end(), w.begin(), w.end());
    if (want.numel() >= 1024)
      EXPECT_CLOSE(g, w, 1.5e-1, name);
    else
      std::printf("[ measure  ] %s (%lld elements, global bar only): rel L2 %.2e\n", name.c_str(),
                  static_cast<long long>(want.numel()), rel_l2(g, w));
  }
  EXPECT_CLOSE(all_got, all_want, 1e-1, "every gradient together");

  // A rerun on the GPU gives the same bits (deterministic mode is the only mode).
  TextGrads again = TextGrads::zeros_like(gpu.weights());
  const StepPackResult rerun = forward_backward(gpu, in, opt, again);
  EXPECT_EQ(rerun.backward.lm_loss, rg.backward.lm_loss);
  for (size_t i = 0; i < again.named.size(); ++i)
    EXPECT_TRUE(bit_identical(again.named[i].second, gpu_grads.named[i].second))
        << again.named[i].first;
#endif
}

}  // namespace

// The whole text training step on the GPU against the same step on the CPU: forward, loss, and the
// gradient of every trainable parameter, for one pack of several documents with MTP and the
// balancing loss on. The model is gpu_tiny_config() (support/gpu_tiny_model.h); every parameter is
// drawn fresh (seed printed), so both devices see the same values and only the arithmetic differs.
// Two GPU modes: bf16 storage with fp32 accumulation (parameters rounded to bf16 first), and the
// fp32 mode (f32 storage and arithmetic throughout), which must land within 1e-4 of the CPU step,
// AdamW update included. Skipped where no GPU is visible.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/train/freeze.h"
#include "glmtune/train/optimizer.h"
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
// bias, ...), rounded to bf16 when `storage` is bf16.
void redraw(ParamStore& store, std::mt19937_64& rng, DType storage) {
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
        Tensor::from_doubles(v, p.value.shape(), DType::f32).to(storage).to(DType::f32);
  }
}

// A tiny-preset checkpoint under `dir`, loaded and redrawn (see redraw).
ParamStore random_store(const ModelConfig& config, const TempDir& dir, std::mt19937_64& rng,
                        DType storage) {
  InitOptions init;
  init.seed = test_seed();
  write_random_checkpoint(config, dir.path() / "ck", init);
  ParamStore store = ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
  redraw(store, rng, storage);
  return store;
}

// Three documents (lengths 1, 70 and 57) and a padding document of 8, random tokens, each real
// document's next-token labels.
PackInput random_pack(const ModelConfig& config, std::mt19937_64& rng) {
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
  return in;
}

// The store's text parameters (the vision tower is not part of the text step) as the optimizer
// takes them.
std::vector<train::NamedParam> text_params(const ParamStore& store) {
  std::vector<train::NamedParam> params;
  for (train::NamedParam& p : train::named_params(store))
    if (p.name.rfind("model.visual.", 0) != 0) params.push_back(std::move(p));
  return params;
}

// text_params with each value a copy of its own (so two optimizers can update the same starting
// point independently).
std::vector<train::NamedParam> copied_params(const ParamStore& store) {
  std::vector<train::NamedParam> params = text_params(store);
  for (train::NamedParam& p : params) p.value = p.value.contiguous().clone();
  return params;
}

// The gradients of `grads` on the CPU in the order of `params` (undefined for frozen ones).
std::vector<Tensor> aligned_grads(const std::vector<train::NamedParam>& params,
                                  const TextGrads& grads) {
  std::map<std::string, Tensor> by_name;
  for (const auto& [name, g] : grads.named) by_name.emplace(name, g);
  std::vector<Tensor> out;
  for (const train::NamedParam& p : params) {
    const auto it = by_name.find(p.name);
    if (p.trainable) EXPECT_TRUE(it != by_name.end()) << "no gradient for " << p.name;
    out.push_back(p.trainable && it != by_name.end() ? it->second.to(Device::cpu()) : Tensor());
  }
  return out;
}

// One training step of the same random pack on the f32 CPU model and on the GPU model with weights
// in `gpu_dtype`, each into gradients of its own; the label tokens and the expert loads must agree
// exactly.
struct BothSteps {
  BothSteps(const ParamStore& store, const ModelConfig& config, std::mt19937_64& rng,
            DType gpu_dtype)
      : cpu(store),
        gpu(store, TextModelOptions{gpu_dtype, kGpu}),
        in(random_pack(config, rng)),
        cpu_grads(TextGrads::zeros_like(cpu.weights())),
        gpu_grads(TextGrads::zeros_like(gpu.weights())) {
    opt.balancing_alpha = 0.01;
    rc = forward_backward(cpu, in, opt, cpu_grads);
    rg = forward_backward(gpu, in, opt, gpu_grads);
    EXPECT_EQ(rg.backward.lm_tokens, rc.backward.lm_tokens);
    EXPECT_EQ(rg.loads.size(), rc.loads.size());
    for (size_t r = 0; r < std::min(rc.loads.size(), rg.loads.size()); ++r)
      EXPECT_TRUE(bit_identical(rg.loads[r].counts, rc.loads[r].counts)) << rc.loads[r].bias_name;
  }

  const TextModel cpu, gpu;
  const PackInput in;
  TrainOptions opt;
  TextGrads cpu_grads, gpu_grads;
  StepPackResult rc, rg;
};

double frobenius(const Tensor& t) {
  double sum = 0;
  for (const double v : t.to(Device::cpu()).to_doubles()) sum += v * v;
  return std::sqrt(sum);
}

// Every GPU gradient against the CPU one by relative L2 distance: each tensor of at least 1024
// elements within `tensor_bar`, smaller ones within `small_bar` (only printed when it is 0), and
// all of them together within `global_bar`.
void compare_gradients(const TextGrads& cpu_grads, const TextGrads& gpu_grads, double tensor_bar,
                       double small_bar, double global_bar) {
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
      EXPECT_CLOSE(g, w, tensor_bar, "gradient of " + name);
    else if (small_bar > 0)
      EXPECT_CLOSE(g, w, small_bar, "gradient of " + name);
    else
      std::printf("[ measure  ] gradient of %s (%lld elements, global bar only): rel L2 %.2e\n",
                  name.c_str(), static_cast<long long>(want.numel()), rel_l2(g, w));
  }
  EXPECT_CLOSE(all_got, all_want, global_bar, "every gradient together");
}
#endif

TEST(CudaModelStep, LossAndEveryGradientMatchTheCpuStep) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const ModelConfig config = gpu_tiny_config();
  TempDir dir("cuda-step");
  std::mt19937_64 rng(test_seed());
  const ParamStore store = random_store(config, dir, rng, DType::bf16);

  BothSteps both(store, config, rng, DType::bf16);
  const StepPackResult &rc = both.rc, &rg = both.rg;

  std::printf("[ measure  ] loss cpu %.6f gpu %.6f; mtp cpu %.6f gpu %.6f\n", rc.backward.lm_loss,
              rg.backward.lm_loss, rc.backward.mtp_loss, rg.backward.mtp_loss);
  EXPECT_NEAR(rg.backward.lm_loss, rc.backward.lm_loss, 2e-3 * rc.backward.lm_loss) << ctx("loss");
  EXPECT_NEAR(rg.backward.mtp_loss, rc.backward.mtp_loss, 2e-3 * rc.backward.mtp_loss + 1e-6)
      << ctx("MTP loss");
  EXPECT_NEAR(rg.backward.balancing_loss, rc.backward.balancing_loss,
              2e-2 * std::abs(rc.backward.balancing_loss) + 1e-7)
      << ctx("balancing loss");

  // Gradients: every activation of the GPU step is rounded to bf16 and the backward of five
  // layers (20 Sinkhorn iterations per mHC site among them) compounds those roundings, so the
  // gradients land several percent from the f32 step: on the H200 (2026-11-29) 1.5e-2 .. 9.5e-2
  // per tensor and 4.6e-2 .. 8.7e-2 for all of them together over five seeds, against 1e-3 ..
  // 1e-2 for a single op (test_cuda_dispatch, test_cuda_ops_*). The first KDA layer's q and k
  // projections (and the conv before them) go furthest: the L2 norm's backward keeps only the
  // part of dq, dk across q, k, which can be a small part, so their relative error grows; at seed
  // 3409662483 they measured 1.2e-1 .. 1.85e-1 with every version of the KDA kernels, those with
  // bf16-operand products and those without. Over 36 seeds (2026-11-30) all gradients together
  // measured 4.5e-2 .. 1.34e-1, the last at seed 380315147, whose first-layer q projection lands
  // at 3.1e-1, to every printed digit the same with the kernels before and after the MoE
  // backward's split for expert parallelism. The bars: all gradients together within 2e-1, each
  // tensor of at least 1024 elements within 4e-1 (a wrong gradient lands near 1 or above; the fp32
  // mode below holds every tensor to 1e-4). Small tensors (mHC base and scale, A_log: a few to a
  // few hundred sums over all tokens, where cancellation makes the relative error meaningless) are
  // printed and held by the global bar; their op-level tests hold them tightly.
  compare_gradients(both.cpu_grads, both.gpu_grads, 4e-1, 0, 2e-1);

  // A rerun on the GPU gives the same bits (deterministic mode is the only mode).
  TextGrads again = TextGrads::zeros_like(both.gpu.weights());
  const StepPackResult rerun = forward_backward(both.gpu, both.in, both.opt, again);
  EXPECT_EQ(rerun.backward.lm_loss, rg.backward.lm_loss);
  for (size_t i = 0; i < again.named.size(); ++i)
    EXPECT_TRUE(bit_identical(again.named[i].second, both.gpu_grads.named[i].second))
        << again.named[i].first;
#endif
}

// train.freeze on the GPU step: the frozen parameters (one of every kind the GPU backward
// handles: routed experts, the q/k/v conv, an mHC site, embedding and head, router, shared expert,
// MLA kv_b_proj (the absorbed path) and norms, the KDA gate's dt_bias / A_log / f_b_proj, the MTP
// input mixer) get no gradient buffer, and every other gradient, the input-embedding gradient and
// the objective are bit-identical to the step without freezing (the GPU step is deterministic).
TEST(CudaModelStep, FrozenParametersGetNoGradientAndTheRestIsBitIdentical) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  std::mt19937_64 rng(test_seed() + 5);
  const ModelConfig config = gpu_tiny_config();
  TempDir dir("cuda-step-freeze");
  ParamStore all = random_store(config, dir, rng, DType::bf16);
  ParamStore some = ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
  for (const InternalParam& p : all.params()) some.get(p.name) = p.value;  // the same redraw
  const train::FreezePlan plan = train::apply_freeze(
      some,
      {"mlp\\.experts\\.", "self_attn\\.[qkv]_conv1d", "layers\\.0\\.hc_attn_", "embed_tokens",
       "lm_head", "mlp\\.gate\\.weight", "shared_experts\\.down_proj", "kv_b_proj", "q_a_layernorm",
       "o_norm", "dt_bias", "A_log", "f_b_proj", "eh_proj"},
      "test");
  const TextModel full(all, TextModelOptions{DType::bf16, kGpu});
  const TextModel frozen(some, TextModelOptions{DType::bf16, kGpu});
  const PackInput in = random_pack(config, rng);
  TrainOptions opt;
  opt.balancing_alpha = 0.01;
  TextGrads g_all = TextGrads::zeros_like(full.weights());
  TextGrads g_some = TextGrads::zeros_like(frozen.weights());
  const StepPackResult r_all = forward_backward(full, in, opt, g_all);
  const StepPackResult r_some = forward_backward(frozen, in, opt, g_some);
  EXPECT_EQ(r_all.backward.objective(), r_some.backward.objective());
  EXPECT_TRUE(bit_identical(r_all.backward.d_embeddings, r_some.backward.d_embeddings));
  const std::set<std::string> frozen_names(plan.frozen.begin(), plan.frozen.end());
  std::map<std::string, Tensor> kept(g_some.named.begin(), g_some.named.end());
  int64_t compared = 0, skipped = 0;
  for (const auto& [name, g] : g_all.named) {
    if (frozen_names.count(name)) {
      EXPECT_EQ(kept.count(name), 0u) << name << " is frozen but has a gradient buffer";
      ++skipped;
      continue;
    }
    ASSERT_EQ(kept.count(name), 1u) << name;
    EXPECT_TRUE(bit_identical(g, kept[name])) << name;
    ++compared;
  }
  for (const LayerGrads& l : g_some.layers) {
    EXPECT_FALSE(l.moe.gate_up_proj.weight.defined());
    EXPECT_FALSE(l.kda.conv1d.defined());
  }
  EXPECT_EQ(skipped, int64_t(plan.frozen.size()));
  EXPECT_GT(compared, 10);
  std::printf("[ measure  ] %ld frozen tensors without gradients, %ld others bit-identical\n",
              long(skipped), long(compared));
#endif
}

// A model whose head dims the GPU kernels do not take (the plain tiny preset: KDA head dim 16) is
// refused when it is loaded on a GPU, naming the config key and the fix, before any GPU work (so
// this runs without a GPU too).
TEST(CudaModelStep, ModelOutsideTheKernelsGeometryIsRefusedAtLoad) {
  TempDir dir("cuda-geometry");
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions init;
  init.seed = 7;
  write_random_checkpoint(config, dir.path() / "ck", init);
  const ParamStore store = ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
  TextModelOptions gpu_options;
  gpu_options.dtype = DType::bf16;
  gpu_options.device = Device::cuda(0);
  try {
    const TextModel model(store, gpu_options);
    FAIL() << "a KDA head dim of 16 was accepted on the GPU";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("head dim of 128"), std::string::npos) << e.problem();
    EXPECT_NE(e.where().find("text_config.linear_attn_config.head_dim"), std::string::npos)
        << e.where();
    EXPECT_NE(e.fix().find("device = \"cpu\""), std::string::npos) << e.fix();
  }
}

}  // namespace

// The fp32 mode: f32 weights on the GPU, every activation and kernel in f32 (no TF32, no bf16
// activations), against the f32 CPU step. Measured the way the test above measures (relative L2
// distance per tensor, support/cuda_test_support.h's rel_l2): the losses, all gradients together
// and each parameter after one AdamW update from those gradients (the same optimizer, fed the CPU
// and the GPU gradients) within 1e-4, and so is each gradient tensor. The remaining differences
// are summation order and the bf16 parts the tensor-core kernels split f32 operands into (three
// in the KDA core, about 2^-24 relative; two in the mHC mixing products).
TEST(CudaModelStep, Fp32StepMatchesTheCpuStepWithin1e4) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const ModelConfig config = gpu_tiny_config();
  TempDir dir("cuda-step-f32");
  std::mt19937_64 rng(test_seed());
  ParamStore store = random_store(config, dir, rng, DType::f32);
  train::make_params_writable(store);

  BothSteps both(store, config, rng, DType::f32);
  const StepPackResult &rc = both.rc, &rg = both.rg;

  constexpr double kBar = 1e-4;
  std::printf("[ measure  ] loss cpu %.9f gpu %.9f; mtp cpu %.9f gpu %.9f\n", rc.backward.lm_loss,
              rg.backward.lm_loss, rc.backward.mtp_loss, rg.backward.mtp_loss);
  EXPECT_NEAR(rg.backward.lm_loss, rc.backward.lm_loss, kBar * rc.backward.lm_loss) << ctx("loss");
  EXPECT_NEAR(rg.backward.mtp_loss, rc.backward.mtp_loss, kBar * rc.backward.mtp_loss)
      << ctx("MTP loss");
  EXPECT_NEAR(rg.backward.balancing_loss, rc.backward.balancing_loss,
              kBar * std::abs(rc.backward.balancing_loss))
      << ctx("balancing loss");
  // All gradients together, and every tensor of 1024 elements or more, within 1e-4. The small
  // tensors (a few elements per head or per mHC site: dt_bias, A_log, mHC base and scale) are each
  // a sum over the T = 512 tokens of terms of either sign, so one element that nearly cancels
  // carries the whole rounding of its terms: about √T ≈ 23 times the per-term error, more where
  // it cancels deeper. The largest per-term error is the mHC mixing kernels' two bf16 parts per
  // f32 operand (2^-17 ≈ 7.6e-6), so their bar is 2^-17 · √T · 8 = 1.4e-3 (the f32 sums of the
  // CPU and the KDA core's three parts err less). Measured in docs/testing.md: mHC scale up to
  // 4.3e-4 and A_log 1.1e-4 over 30 seeds.
  constexpr double kSmallSumBar = 1.4e-3;
  compare_gradients(both.cpu_grads, both.gpu_grads, kBar, kSmallSumBar, kBar);

  // One AdamW step from the same starting point with either device's gradients. A first step
  // moves each weight by lr·g/(|g| + eps), about lr·sign(g), so an element whose gradient is zero
  // to within the gradients' error may step the other way: 2·lr apart. The learning rate keeps
  // such a flip far below the bar even on the smallest trained tensors (dt_bias, about 1 in
  // norm): at 1e-4 one flip there measured 2e-4 (2026-11-29, on two seeds of six, before and
  // after the tensor-core mHC products).
  constexpr double kLr = 1e-6;
  train::AdamW cpu_adamw(copied_params(store)), gpu_adamw(copied_params(store));
  const train::StepReport sc =
      cpu_adamw.step(aligned_grads(cpu_adamw.params(), both.cpu_grads), kLr);
  const train::StepReport sg =
      gpu_adamw.step(aligned_grads(gpu_adamw.params(), both.gpu_grads), kLr);
  ASSERT_FALSE(sc.skipped || sg.skipped);
  EXPECT_NEAR(sg.grad_norm, sc.grad_norm, kBar * sc.grad_norm) << ctx("global gradient norm");
  const std::vector<train::NamedParam> before = text_params(store);
  for (size_t i = 0; i < cpu_adamw.params().size(); ++i) {
    const train::NamedParam& want = cpu_adamw.params()[i];
    if (!want.trainable) continue;
    EXPECT_FALSE(bit_identical(want.value, before[i].value)) << want.name << " was not updated";
    EXPECT_CLOSE(gpu_adamw.params()[i].value, want.value, kBar, "AdamW-updated " + want.name);
  }
#endif
}

// LoRA on the GPU step: adapters of rank 4 on each group of projections and on all of them (an
// adapter on the MLA kv_b_proj turns its layer off the absorbed-latent form), A and B drawn
// nonzero, the base frozen. Only the adapters get gradient buffers, and they match the CPU step: in
// the fp32 mode within the fp32 step's 1e-4 (each adapter tensor is a few hundred to a few
// thousand sums over all 136 tokens, as large as the tensors the fp32 step holds to 1e-4), in
// bf16 within the bf16 step's bars.
struct LoraGroup {
  const char* name;
  std::vector<std::string> targets;
  std::vector<std::string> parameters = {};  // lora.target_parameters: the routed experts
};

const std::vector<std::string> kRoutedExperts = {"mlp.experts.gate_up_proj",
                                                 "mlp.experts.down_proj"};

class CudaLoraStep : public ::testing::TestWithParam<LoraGroup> {};

TEST_P(CudaLoraStep, AdapterGradientsMatchTheCpuStep) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const ModelConfig config = gpu_tiny_config();
  for (const DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    TempDir dir("cuda-step-lora");
    std::mt19937_64 rng(test_seed() + 11);
    ParamStore store = random_store(config, dir, rng, dtype);
    LoraConfig lora;
    lora.rank = 4;
    lora.alpha = 8;
    lora.target_modules = GetParam().targets;
    lora.target_parameters = GetParam().parameters;
    const std::vector<std::string> modules = resolve_lora_targets(store, lora, "test");
    add_lora_adapters(store, lora, modules, test_seed());
    std::normal_distribution<double> n(0.0, 1.0);
    int64_t adapters = 0;
    for (const InternalParam& p : store.params()) {
      if (!p.adapter) {
        store.set_trainable(p.name, false);
        continue;
      }
      ++adapters;
      // B nonzero (PEFT starts it at zero, which would leave dA zero), A redrawn alike; values
      // both devices hold exactly. B A about a fifth of its weight, as a trained adapter's delta
      // is small beside the weight: adapters that dwarf their weights on all 56 projections
      // double the activations, and the bf16 step's error with them (measured 0.75 on one
      // adapter gradient, against the bf16 step's 4e-1 bar).
      std::vector<double> v(size_t(p.value.numel()));
      const double sd =
          (p.name.ends_with(".lora_B.weight") ? 0.1 : 1.0) / std::sqrt(double(p.value.size(-1)));
      for (double& x : v) x = sd * n(rng);
      store.get(p.name) =
          Tensor::from_doubles(v, p.value.shape(), DType::f32).to(dtype).to(DType::f32);
    }
    ASSERT_EQ(adapters, 2 * int64_t(modules.size()));

    BothSteps both(store, config, rng, dtype);
    ASSERT_EQ(both.gpu_grads.named.size(), size_t(adapters));
    // The CPU step again with the adapted base weights trainable: the gradient dW of each, which
    // the adapter's gradients see through the other factor (dA = s·Bᵀ·dW, dB = s·dW·Aᵀ).
    std::map<std::string, Tensor> base_grads;
    if (dtype == DType::bf16) {
      ParamStore with_base = store;
      for (const std::string& m : modules)
        with_base.set_trainable(with_base.contains(m + ".weight") ? m + ".weight" : m, true);
      const TextModel cpu_base(with_base);
      TextGrads g = TextGrads::zeros_like(cpu_base.weights());
      forward_backward(cpu_base, both.in, both.opt, g);
      for (auto& [name, t] : g.named) base_grads.emplace(name, t);
    }
    for (const auto& [name, g] : both.gpu_grads.named)
      EXPECT_TRUE(name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight"))
          << name << " has a gradient buffer although the base is frozen";
    const double loss_bar = dtype == DType::f32 ? 1e-4 : 2e-3;
    const std::string mode(dtype_name(dtype));
    std::printf("[ measure  ] %s %s: %zu adapters, loss cpu %.9f gpu %.9f\n", GetParam().name,
                mode.c_str(), modules.size(), both.rc.backward.lm_loss, both.rg.backward.lm_loss);
    EXPECT_NEAR(both.rg.backward.lm_loss, both.rc.backward.lm_loss,
                loss_bar * both.rc.backward.lm_loss)
        << ctx("loss");
    double worst = 0;
    std::string worst_name;
    for (size_t i = 0; i < both.cpu_grads.named.size(); ++i) {
      const double rel = rel_l2(both.gpu_grads.named[i].second.to(Device::cpu()).to_doubles(),
                                both.cpu_grads.named[i].second.to_doubles());
      if (rel > worst) worst = rel, worst_name = both.cpu_grads.named[i].first;
    }
    std::printf("[ measure  ] %s %s: worst adapter gradient rel L2 %.2e (%s)\n", GetParam().name,
                mode.c_str(), worst, worst_name.c_str());
    std::fflush(stdout);
    if (dtype == DType::f32) {
      compare_gradients(both.cpu_grads, both.gpu_grads, 1e-4, 1e-4, 1e-4);
      continue;
    }
    // bf16: the full step (LossAndEveryGradientMatchTheCpuStep) holds every weight gradient dW
    // within 4e-1 (the worst, a KDA layer's q or k projection, measured 3.1e-1). An adapter's
    // gradient is dW seen through the other factor, so its error is at most s·‖B‖·‖ΔdW‖ (dA) or
    // s·‖ΔdW‖·‖A‖ (dB), Frobenius norms: at most 4e-1 · s·‖B‖·‖dW‖. Its own relative error can
    // be far larger than dW's: rank 4 keeps four directions of dW, which can hold little of it
    // (seed 2687060909: the first layers' q, k and v adapters at 0.37 .. 0.45 where their dW
    // were at 0.05 .. 0.14). Each adapter gradient is held to that bound, or to 4e-1 of itself
    // where that is larger; the f32 mode above checks the same kernels to 1e-4.
    const double s = lora.scale();
    for (size_t i = 0; i < both.cpu_grads.named.size(); ++i) {
      const auto& [name, want] = both.cpu_grads.named[i];
      ASSERT_EQ(both.gpu_grads.named[i].first, name);
      const bool is_a = name.ends_with(".lora_A.weight");
      const std::string module = name.substr(0, name.size() - std::string(".lora_A.weight").size());
      const std::string base = store.contains(module + ".weight") ? module + ".weight" : module;
      ASSERT_TRUE(base_grads.count(base)) << "no base gradient for " << name;
      const Tensor& other = store.get(module + (is_a ? ".lora_B.weight" : ".lora_A.weight"));
      const std::vector<double> got = both.gpu_grads.named[i].second.to(Device::cpu()).to_doubles(),
                                w = want.to_doubles();
      double err = 0, norm = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        err += (got[k] - w[k]) * (got[k] - w[k]);
        norm += w[k] * w[k];
      }
      err = std::sqrt(err);
      norm = std::sqrt(norm);
      const double bound = 4e-1 * s * frobenius(other) * frobenius(base_grads.at(base));
      std::printf("[ measure  ] gradient of %s: rel L2 %.2e, error %.3e (bound %.3e)\n",
                  name.c_str(), err / norm, err, bound);
      EXPECT_LE(err, std::max(bound, 4e-1 * norm)) << ctx("gradient of " + name);
    }
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Targets, CudaLoraStep,
    ::testing::Values(
        LoraGroup{"kda_qkv", {"q_proj", "k_proj", "v_proj"}},
        LoraGroup{"kda_gates", {"f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"}},
        LoraGroup{"o_proj", {"o_proj"}},
        LoraGroup{"mla", {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"}},
        LoraGroup{"mla_kv_b", {"kv_b_proj"}},
        LoraGroup{"dense_mlp", {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}},
        LoraGroup{
            "shared_expert",
            {"shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"}},
        LoraGroup{"all", {"all-linear"}}, LoraGroup{"routed_experts", {}, kRoutedExperts},
        LoraGroup{"all_and_routed_experts", {"all-linear"}, kRoutedExperts}),
    [](const ::testing::TestParamInfo<LoraGroup>& info) { return std::string(info.param.name); });

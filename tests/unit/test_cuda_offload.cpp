// Activation offload on the GPU: the copies of tensor/host_offload.h (views of one storage stay
// one storage, every byte comes back, the device memory is returned once a copy is finished), and
// the training step of the tiny preset with every decoder layer offloaded, or a mix of recompute,
// offload and keep, giving the same gradient bits as keep and as recompute while the forward leaves
// less device memory behind (caching allocator statistics); keep and recompute again with the FP8
// GEMMs. Skipped where no GPU is visible.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/host_offload.h"
#include "support/cuda_test_support.h"
#include "support/gpu_tiny_model.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::model;
using namespace glmtune::model::text;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
size_t device_allocated() { return cuda_allocator(kGpu.index).stats().allocated; }
size_t pinned_allocated() { return HostOffload::of(kGpu).pinned_memory().stats().allocated; }
#endif

}  // namespace

TEST(CudaOffload, TensorsGoToPinnedMemoryAndComeBackBitForBit) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  HostOffload& offload = HostOffload::of(kGpu);
  // One storage seen through three views (rows in the middle, a transpose, the whole), a second
  // storage of another dtype, integers, an undefined and an empty tensor.
  const Tensor base_cpu = random_cpu({96, 300}, DType::bf16, 1);
  const Tensor other_cpu = random_cpu({7, 33}, DType::f32, 2);
  std::vector<int32_t> ints(1000);
  std::mt19937_64 rng = seeded_engine(3);
  for (int32_t& v : ints) v = int32_t(rng());
  const Tensor ints_cpu = Tensor::from_vector(ints, {10, 100});
  Tensor base = base_cpu.to(kGpu);
  std::vector<Tensor> tensors = {base.narrow(0, 40, 20),
                                 base.transpose(0, 1),
                                 base,
                                 other_cpu.to(kGpu),
                                 ints_cpu.to(kGpu),
                                 Tensor(),
                                 Tensor::empty({0, 4}, DType::bf16, kGpu)};
  const std::vector<Tensor> want = {base_cpu.narrow(0, 40, 20), base_cpu.transpose(0, 1), base_cpu,
                                    other_cpu, ints_cpu};
  base = Tensor();
  std::vector<Tensor*> ptrs;
  for (Tensor& t : tensors) ptrs.push_back(&t);

  const size_t device_before = device_allocated(), pinned_before = pinned_allocated();
  Transfer out = offload.to_host(ptrs);
  EXPECT_TRUE(out.pending());
  for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(tensors[i].device().is_cpu()) << i;
  EXPECT_FALSE(tensors[5].defined());
  EXPECT_TRUE(tensors[6].device().is_cpu());
  EXPECT_EQ(tensors[6].shape(), (Shape{0, 4}));
  EXPECT_EQ(tensors[0].storage(), tensors[1].storage());
  EXPECT_EQ(tensors[0].storage(), tensors[2].storage());
  EXPECT_NE(tensors[2].storage(), tensors[3].storage());
  EXPECT_EQ(tensors[1].strides(), want[1].strides());
  // The sources stay on the device until the copy is finished, then go back to the allocator.
  EXPECT_EQ(device_allocated(), device_before);
  out.finish();
  EXPECT_FALSE(out.pending());
  const size_t copied = want[2].nbytes() + want[3].nbytes() + want[4].nbytes();
  EXPECT_GE(device_before - device_allocated(), copied);
  EXPECT_GE(pinned_allocated() - pinned_before, copied);

  Transfer in = offload.to_device(ptrs);
  in.finish();
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(tensors[i].device(), kGpu) << i;
    EXPECT_TRUE(bit_identical(tensors[i], want[i])) << ctx("tensor " + std::to_string(i));
  }
  EXPECT_EQ(tensors[0].storage(), tensors[2].storage());
  EXPECT_EQ(tensors[6].device(), kGpu);
  // The host copies went back to the cache with the transfer.
  EXPECT_EQ(pinned_allocated(), pinned_before);
#endif
}

TEST(CudaOffload, StepGradientsMatchKeepAndRecomputeWithLessDeviceMemory) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const ModelConfig config = gpu_tiny_config();
  TempDir dir("cuda-offload");
  InitOptions init;
  init.seed = test_seed();
  write_random_checkpoint(config, dir.path() / "ck", init);
  const ParamStore store = ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
  TextModelOptions gpu_options;
  gpu_options.dtype = DType::bf16;
  gpu_options.device = kGpu;
  const TextModel model(store, gpu_options);
  const int64_t layers = model.text().num_hidden_layers;

  // Four documents and a padding document.
  const std::vector<int32_t> cu = {0, 90, 200, 301, 500, 512};
  const int64_t tokens = cu.back();
  std::mt19937_64 rng = seeded_engine(4);
  std::uniform_int_distribution<int32_t> token(1, int32_t(config.text().vocab_size) - 1);
  std::vector<int32_t> ids(static_cast<size_t>(tokens)), labels(static_cast<size_t>(tokens), -100);
  for (int32_t& id : ids) id = token(rng);
  for (size_t d = 0; d + 2 < cu.size(); ++d)
    for (int32_t i = cu[d]; i + 1 < cu[d + 1]; ++i) labels[size_t(i)] = ids[size_t(i + 1)];
  PackInput in;
  in.input_ids = Tensor::from_vector(ids, {tokens});
  in.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())});
  in.labels = Tensor::from_vector(labels, {tokens});
  in.padding_tokens = 12;

  TrainOptions keep;
  keep.balancing_alpha = 0.01;
  TrainOptions recompute = keep;
  recompute.activations = activation_policy(layers, 1);
  recompute.recompute_mtp = true;
  TrainOptions offload = keep;
  offload.activations = activation_policy(layers, 0, 1);
  TrainOptions mixed = keep;
  mixed.activations = activation_policy(layers, 0.4, 0.4);
  ASSERT_EQ(
      std::count(mixed.activations.begin(), mixed.activations.end(), ActivationPolicy::offload), 2);

  // Device memory the forward leaves for the backward, and what offload put in host memory.
  const auto forward_memory = [&](const TrainOptions& opt, size_t* pinned) -> size_t {
    const size_t device_before = device_allocated(), pinned_before = pinned_allocated();
    const TrainForward f = training_forward(model, in, opt);
    const size_t saved = device_allocated() - device_before;
    *pinned = pinned_allocated() - pinned_before;
    for (int64_t l = 0; l < layers; ++l) {
      const ActivationPolicy policy = f.context->policies[size_t(l)];
      EXPECT_EQ(policy,
                opt.activations.empty() ? ActivationPolicy::keep : opt.activations[size_t(l)]);
      const Tensor& attn_in = f.context->layers[size_t(l)].attn_in;
      if (policy == ActivationPolicy::recompute) {
        EXPECT_FALSE(attn_in.defined()) << "layer " << l;
      } else {
        EXPECT_TRUE(attn_in.defined() &&
                    attn_in.device().is_cpu() == (policy == ActivationPolicy::offload))
            << "layer " << l << ": " << (attn_in.defined() ? attn_in.str() : "no context");
      }
    }
    return saved;
  };
  size_t pinned_keep = 0, pinned_offload = 0;
  const size_t saved_keep = forward_memory(keep, &pinned_keep);
  const size_t saved_offload = forward_memory(offload, &pinned_offload);
  std::printf(
      "[ measure  ] device memory left by the forward: keep %.2f MiB, offload %.2f MiB; pinned "
      "host %.2f MiB\n",
      saved_keep / 1048576.0, saved_offload / 1048576.0, pinned_offload / 1048576.0);
  EXPECT_EQ(pinned_keep, 0u);
  EXPECT_GT(pinned_offload, 0u);
  // The offloaded bytes left the device (most of them: a storage that something kept on the
  // device still holds stays there, and the allocators round differently).
  EXPECT_LT(saved_offload + pinned_offload / 2, saved_keep);

  TextGrads gk = TextGrads::zeros_like(model.weights());
  TextGrads gr = TextGrads::zeros_like(model.weights());
  TextGrads go = TextGrads::zeros_like(model.weights());
  TextGrads gm = TextGrads::zeros_like(model.weights());
  const size_t pinned_idle = pinned_allocated();
  const StepPackResult rk = forward_backward(model, in, keep, gk);
  const StepPackResult rr = forward_backward(model, in, recompute, gr);
  const StepPackResult ro = forward_backward(model, in, offload, go);
  const StepPackResult rm = forward_backward(model, in, mixed, gm);
  // The host copies live as long as the context, no longer.
  EXPECT_EQ(pinned_allocated(), pinned_idle);
  EXPECT_EQ(rk.backward.objective(), rr.backward.objective());
  EXPECT_EQ(rk.backward.objective(), ro.backward.objective());
  EXPECT_EQ(rk.backward.objective(), rm.backward.objective());
  EXPECT_TRUE(bit_identical(rk.backward.d_embeddings, ro.backward.d_embeddings));
  ASSERT_EQ(gk.named.size(), go.named.size());
  double total = 0;
  for (size_t i = 0; i < gk.named.size(); ++i) {
    const std::string& name = gk.named[i].first;
    EXPECT_TRUE(bit_identical(gk.named[i].second, gr.named[i].second)) << ctx(name + " recompute");
    EXPECT_TRUE(bit_identical(gk.named[i].second, go.named[i].second)) << ctx(name + " offload");
    EXPECT_TRUE(bit_identical(gk.named[i].second, gm.named[i].second)) << ctx(name + " mixed");
    for (double x : gk.named[i].second.to_doubles()) total += std::abs(x);
  }
  EXPECT_GT(total, 0);

  // With the FP8 GEMMs (train.fp8 = "tilewise"): a kept layer's feed-forward projections and its
  // experts' gate/up are the forward's FP8 products, the down projection its backward runs again
  // quantises the same activation, and a recomputed layer reruns them all: the same bits.
  TextModel fp8_model(store, gpu_options);
  ASSERT_GT(use_fp8_gemms(fp8_model.weights(), 16), 0);
  TextGrads fk = TextGrads::zeros_like(fp8_model.weights());
  TextGrads fr = TextGrads::zeros_like(fp8_model.weights());
  const StepPackResult f_keep = forward_backward(fp8_model, in, keep, fk);
  const StepPackResult f_recompute = forward_backward(fp8_model, in, recompute, fr);
  EXPECT_EQ(f_keep.backward.objective(), f_recompute.backward.objective());
  EXPECT_NE(f_keep.backward.objective(), rk.backward.objective()) << "the FP8 GEMMs did not run";
  ASSERT_EQ(fk.named.size(), fr.named.size());
  for (size_t i = 0; i < fk.named.size(); ++i)
    EXPECT_TRUE(bit_identical(fk.named[i].second, fr.named[i].second))
        << ctx(fk.named[i].first + " fp8 recompute");
#endif
}

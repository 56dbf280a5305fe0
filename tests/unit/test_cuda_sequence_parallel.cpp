// The sequence-parallel hooks (dist/sequence_parallel.h) on GPU tensors: the training step through
// UlyssesParallel over a one-rank group whose device tensors move through NCCL, against the plain
// GPU step. With one rank the shard is the whole pack and every head is local, but the exchanges,
// the head-sliced parameters, the mixers' generic op path (the DSA projections, selection and
// attention as separate ops, the backward rebuilding the MLA context) and the gradient blocks'
// accumulation all run on the device. The split over two GPUs is tests/gpu/dist_check.sh's.
// Skipped where no GPU is visible.

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>

#include "glmtune/dist/comm.h"
#include "glmtune/dist/sequence_parallel.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "support/cuda_test_support.h"
#include "support/gpu_tiny_model.h"
#include "support/random_pack.h"
#include "support/temp_dir.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/dist/comm_nccl.h"
#endif

using namespace glmtune;
using namespace glmtune::model::text;
using namespace glmtune::test;

TEST(CudaSequenceParallel, OneRankGroupGivesThePlainStep) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  TempDir dir("cuda-sp");
  const model::ParamStore store = random_gpu_tiny_store(dir.path() / "ck", test_seed());
  const model::ModelConfig& config = store.config();
  const PackInput in = random_pack(config, test_seed(), {0, 60, 61, 150, 160}, 10);
  TrainOptions opt;
  opt.balancing_alpha = 0.01;

  TextModel model(store, TextModelOptions{DType::bf16, kGpu});
  TextGrads want_grads = TextGrads::zeros_like(model.weights());
  const StepPackResult want = forward_backward(model, in, opt, want_grads);

  std::unique_ptr<dist::Communicator> host_group = dist::make_self_communicator("sp");
  std::unique_ptr<dist::Communicator> device_group =
      dist::make_nccl_communicator(*host_group, 0, 60.0);
  const model::TextConfig& tc = config.text();
  dist::UlyssesParallel sp(*host_group, tc.linear_num_heads, tc.num_attention_heads,
                           "train.sp_size", device_group.get());
  opt.sequence_parallel = &sp;
  TextGrads grads = TextGrads::zeros_like(model.weights());
  const StepPackResult got = forward_backward(model, in, opt, grads);

  // The DSA mixer takes another op path (separate projection, selection and attention ops, and a
  // rebuilt context in the backward) made of the same kernels as the fused one: equal on the H200
  // (loss and all 148 gradients); the bars leave room for an atomic sum ordered otherwise.
  const double loss_rel =
      std::abs(got.backward.lm_loss_sum - want.backward.lm_loss_sum) / want.backward.lm_loss_sum;
  std::printf("[ measure  ] loss sum %.6f against %.6f (rel %.2e)\n", got.backward.lm_loss_sum,
              want.backward.lm_loss_sum, loss_rel);
  EXPECT_LE(loss_rel, 1e-6);
  EXPECT_EQ(got.backward.lm_tokens, want.backward.lm_tokens);
  ASSERT_EQ(got.loads.size(), want.loads.size());
  for (size_t r = 0; r < got.loads.size(); ++r)
    EXPECT_TRUE(bit_identical(got.loads[r].counts, want.loads[r].counts)) << got.loads[r].bias_name;
  std::map<std::string, Tensor> by_name;
  for (const auto& [name, g] : grads.named) by_name[name] = g;
  double worst = 0;
  std::string worst_name;
  for (const auto& [name, g] : want_grads.named) {
    if (!g.defined()) continue;
    ASSERT_TRUE(by_name.count(name) && by_name[name].defined()) << name;
    const double err = rel_l2(by_name[name], g);
    if (err > worst) worst = err, worst_name = name;
    EXPECT_LE(err, 1e-6) << name;
  }
  std::printf("[ measure  ] %zu gradients: worst rel L2 %.2e (%s)\n", want_grads.named.size(),
              worst, worst_name.c_str());
#endif
}

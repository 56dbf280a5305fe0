// One data-parallel training step under mpirun against the single-process step: the packs of
// the step are split over the ranks (SPEC.md §4: global denominators, gradients summed), and the
// summed loss terms, every parameter gradient, the expert loads and the sharded optimizer's
// update equal what one process computes from all the packs. The same with the routed experts
// split over ep groups of 2 (expert parallelism): tokens travel to their experts' ranks and back.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../unit/support/temp_dir.h"
#include "dist_support.h"
#include "glmtune/base/error.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/dist/sharded_optimizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/train/optimizer.h"
#include "mpi_main.h"

namespace glmtune::dist {
namespace {

namespace fs = std::filesystem;
using dist_test::count_targets;
using dist_test::random_pack;
using dist_test::rel_diff;
using dist_test::run_packs;
using dist_test::Step;
using model::text::PackInput;

constexpr int64_t kPacksPerRank = 2;

model::ParamStore load_store(const fs::path& dir) {
  const auto config = model::ModelConfig::from_file((dir / "config.json").string());
  model::ParamStore store = model::ParamStore::load(io::CheckpointReader::open(dir), config);
  train::make_params_writable(store);
  return store;
}

std::vector<train::NamedParam> trainable(const model::ParamStore& store) {
  std::vector<train::NamedParam> params = train::named_params(store);
  for (auto& p : params)
    if (!model::text::is_trainable_param(p.name)) p.trainable = false;
  return params;
}

// One step on `par`: data parallel over every rank, and with `ep_size` > 1 the routed experts
// split over the ep groups.
void check_one_step(ParallelContext& par, int64_t ep_size) {
  const int ranks = par.sizes().world, me = par.rank();
  ASSERT_GT(ranks, 1) << "run under mpirun with 2 or 4 ranks";
  test::TempDir dir("dist-grad-" + std::to_string(me));
  model::InitOptions init;
  init.seed = 5;
  model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", init);
  model::ParamStore store = load_store(dir / "tiny");
  const model::text::TextModel m(store);

  const int64_t packs_total = kPacksPerRank * ranks;
  std::vector<PackInput> all;
  for (int64_t i = 0; i < packs_total; ++i) all.push_back(random_pack(i, 2000));
  model::text::TrainOptions topt;
  topt.activations = model::text::activation_policy(m.text().num_hidden_layers, 0.4);
  topt.mtp = m.has_mtp();
  topt.mtp_depths = m.text().num_nextn_predict_layers;
  topt.balancing_alpha = 0.001;
  topt.num_micro_packs = packs_total;
  int64_t lm_targets = 0;
  std::vector<int64_t> mtp_targets(size_t(topt.mtp_depths), 0);
  for (const auto& in : all) {
    lm_targets += count_targets(in.labels);
    for (int64_t k = 1; k <= topt.mtp_depths; ++k)
      mtp_targets[size_t(k - 1)] += count_targets(model::shift_labels(in.labels, in.cu_seqlens, k));
  }
  topt.lm_denominator = double(lm_targets);
  for (int64_t n : mtp_targets) topt.mtp_denominators.push_back(double(n));

  // Single process: every pack.
  model::text::TextGrads ref_grads = model::text::TextGrads::zeros_like(m.weights());
  const Step ref = run_packs(m, all, topt, ref_grads);

  // This rank's packs, then the sums over the ranks.
  const std::vector<PackInput> mine(all.begin() + me * kPacksPerRank,
                                    all.begin() + (me + 1) * kPacksPerRank);
  std::optional<ExpertParallel> experts;
  if (ep_size > 1) {
    experts.emplace(par.ep(), m.text().n_routed_experts, "test");
    topt.expert_dispatch = &*experts;
  }
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(m.weights());
  Step got = run_packs(m, mine, topt, grads);
  if (experts) {
    // This rank computed its own experts only: the other slices of its expert gradients are
    // untouched, and its slice received the tokens of the whole ep group.
    int64_t expert_tensors = 0;
    for (const auto& [name, g] : grads.named) {
      if (name.find("mlp.experts.") == std::string::npos) continue;
      ++expert_tensors;
      for (int64_t e = 0; e < g.size(0); ++e) {
        const bool local =
            e >= experts->first_expert() && e < experts->first_expert() + experts->local_experts();
        const std::vector<double> v = g.select(0, e).contiguous().to_doubles();
        if (!local)
          EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](double x) { return x == 0; }))
              << name << " expert " << e;
      }
    }
    EXPECT_GT(expert_tensors, 0);
  }
  std::vector<double> sums = {got.lm, got.balancing};
  sums.insert(sums.end(), got.mtp.begin(), got.mtp.end());
  par.world().all_reduce_sum(sums);
  EXPECT_NEAR(sums[0] / topt.lm_denominator, ref.lm / topt.lm_denominator, 1e-6);
  EXPECT_NEAR(sums[1], ref.balancing, 1e-6);
  for (size_t k = 0; k < got.mtp.size(); ++k)
    EXPECT_NEAR(sums[2 + k] / topt.mtp_denominators[k], ref.mtp[k] / topt.mtp_denominators[k],
                1e-6);
  ASSERT_EQ(got.loads.size(), ref.loads.size());
  for (auto& [name, counts] : got.loads) {
    par.world().all_reduce_sum(counts);
    EXPECT_EQ(counts, ref.loads.at(name)) << name;
  }

  // Every gradient, summed over the ranks.
  ASSERT_FALSE(grads.named.empty());
  model::text::TextGrads summed = model::text::TextGrads::zeros_like(m.weights());
  for (size_t i = 0; i < grads.named.size(); ++i) {
    Tensor& g = summed.named[i].second;
    g.copy_(grads.named[i].second);
    par.world().all_reduce(g);
    EXPECT_LE(rel_diff(g, ref_grads.named[i].second), 1e-6) << grads.named[i].first;
  }

  // The sharded optimizer from the local gradients against AdamW on their sum: the same update.
  // (Against AdamW on the single-process gradients, elements whose gradient is near 0 may move
  // by up to lr: Adam's first step is about lr·sign(g), and fp32 reduction order can flip it.)
  model::ParamStore ref_store = load_store(dir / "tiny");
  train::AdamW ref_opt(trainable(ref_store));
  dist::ShardedAdamW opt(trainable(store), {}, par.dp());
  auto grad_list = [&](const model::text::TextGrads& gs, const std::vector<train::NamedParam>& ps) {
    std::vector<Tensor> out(ps.size());
    for (size_t i = 0; i < ps.size(); ++i)
      if (ps[i].trainable) out[i] = *gs.find(ps[i].name);
    return out;
  };
  const double ref_norm = std::sqrt(ref_opt.grad_sq_norm(grad_list(ref_grads, ref_opt.params())));
  const double norm = opt.reduce_gradients(grad_list(grads, opt.params()));
  EXPECT_NEAR(norm, ref_norm, 1e-6 * ref_norm);
  ref_opt.step(grad_list(summed, ref_opt.params()), 1e-3, norm);
  opt.step(1e-3, norm);
  const auto full = opt.gather(0);
  ASSERT_EQ(full != nullptr, par.is_root());
  if (full) {
    for (size_t i = 0; i < ref_opt.params().size(); ++i) {
      if (!ref_opt.params()[i].trainable) continue;
      const std::string& name = ref_opt.params()[i].name;
      EXPECT_LE(rel_diff(full->master(i), ref_opt.master(i)), 1e-6) << name;
      EXPECT_LE(rel_diff(full->exp_avg(i), ref_opt.exp_avg(i)), 1e-6) << name;
      EXPECT_LE(rel_diff(full->exp_avg_sq(i), ref_opt.exp_avg_sq(i)), 1e-5) << name;
    }
    EXPECT_EQ(full->step_count(), 1);
  }
}

TEST(DistDataParallel, OneStepEqualsTheSingleProcessStep) {
  check_one_step(*testing::world_context(), 1);
}

// Experts that do not split evenly over the ep group are a recipe error naming the key.
TEST(DistExpertParallel, RefusesExpertsThatDoNotSplitOverTheGroup) {
  ParallelContext& par = *testing::world_context();
  try {
    ExpertParallel experts(par.world(), 2 * par.sizes().world + 1, "recipe.toml: train.ep_size");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("do not split over"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("train.ep_size"), std::string::npos) << e.what();
  }
}

// ep = 2: on 2 ranks one ep group; on 4 ranks dp × ep with two ep groups of 2.
TEST(DistExpertParallel, OneStepEqualsTheSingleProcessStep) {
  ParallelOptions options;
  options.ep_size = 2;
  options.timeout_s = 300;
  const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
  ASSERT_EQ(par->sizes().ep, 2);
  check_one_step(*par, 2);
}

}  // namespace
}  // namespace glmtune::dist

int main(int argc, char** argv) { return glmtune::dist::testing::run_all_tests(argc, argv); }

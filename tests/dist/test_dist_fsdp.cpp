// Fully sharded data parallel under mpirun (dist/fsdp.h) against the single-process step: with
// the decoder layers' parameters held in slices over the dp group, gathered per layer and
// released after, and each layer's gradient reduce-scattered right after its backward, one
// step's summed losses and every gradient (slices gathered back) equal what one process computes
// from all the packs; between layers each rank holds about 1/P of the decoder-layer bytes
// (measured from the storage that is still alive, not computed from the layout).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "../unit/support/temp_dir.h"
#include "dist_support.h"
#include "glmtune/dist/fsdp.h"
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
using model::text::PackInput;

constexpr int64_t kPacksPerRank = 2;

bool is_layer_name(const std::string& name, int64_t layers) {
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = model::text::layer_prefix(l);
    if (name.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

// Passes every call on and measures what is resident right after each release (between layers)
// and right after each gather (while a layer runs).
class Measured final : public model::text::LayerParamProvider {
 public:
  Measured(ShardedLayers& inner, const model::text::TextWeights& w) : inner_(inner), w_(w) {}
  void gather(int64_t layer) override {
    inner_.gather(layer);
    EXPECT_TRUE(w_.layers[size_t(layer)].input_layernorm.defined()) << "layer " << layer;
    during = std::max(during, inner_.resident_bytes());
    ++gathers;
  }
  void release(int64_t layer) override {
    inner_.release(layer);
    EXPECT_FALSE(w_.layers[size_t(layer)].input_layernorm.defined()) << "layer " << layer;
    between = std::max(between, inner_.resident_bytes());
  }
  void reduce_gradients(int64_t layer) override {
    inner_.reduce_gradients(layer);
    ++reductions;
  }
  int64_t between = 0, during = 0, gathers = 0, reductions = 0;

 private:
  ShardedLayers& inner_;
  const model::text::TextWeights& w_;
};

TEST(DistFsdp, OneStepEqualsTheSingleProcessStepWithShardedLayers) {
  ParallelContext& par = *testing::world_context();
  const int ranks = par.sizes().dp, me = par.dp().rank();
  ASSERT_GT(ranks, 1) << "run under mpirun with 2 or 4 ranks";
  test::TempDir dir("dist-fsdp-" + std::to_string(par.rank()));
  model::InitOptions init;
  init.seed = 11;
  model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", init);
  const auto config = model::ModelConfig::from_file((dir / "tiny" / "config.json").string());
  model::text::TextModel m(
      model::ParamStore::load(io::CheckpointReader::open(dir / "tiny"), config));
  const int64_t layers = m.text().num_hidden_layers;

  std::vector<PackInput> all;
  for (int64_t i = 0; i < kPacksPerRank * ranks; ++i) all.push_back(random_pack(i, 2000));
  model::text::TrainOptions topt;
  // Some layers recomputed, some kept: both gather paths of the backward run.
  topt.activations = model::text::activation_policy(layers, 0.5);
  topt.mtp = m.has_mtp();
  topt.mtp_depths = m.text().num_nextn_predict_layers;
  topt.balancing_alpha = 0.001;
  topt.num_micro_packs = int64_t(all.size());
  int64_t lm_targets = 0;
  std::vector<int64_t> mtp_targets(size_t(topt.mtp_depths), 0);
  for (const auto& in : all) {
    lm_targets += count_targets(in.labels);
    for (int64_t k = 1; k <= topt.mtp_depths; ++k)
      mtp_targets[size_t(k - 1)] += count_targets(model::shift_labels(in.labels, in.cu_seqlens, k));
  }
  topt.lm_denominator = double(lm_targets);
  for (int64_t n : mtp_targets) topt.mtp_denominators.push_back(double(n));

  // Single process, whole weights: every pack, and an evaluation forward to compare with.
  model::text::TextGrads ref_grads = model::text::TextGrads::zeros_like(m.weights());
  double ref_lm = 0, ref_objective = 0;
  for (const PackInput& in : all) {
    const auto r = model::text::forward_backward(m, in, topt, ref_grads);
    ref_lm += r.backward.lm_loss_sum;
    ref_objective += r.backward.objective();
  }
  const model::text::ForwardOutput ref_eval = m.forward(all[0]);

  // The decoder-layer bytes of the whole model, from the weights themselves.
  int64_t layer_bytes = 0;
  for (const auto& [name, t] : m.weights().named)
    if (is_layer_name(name, layers)) layer_bytes += int64_t(t.nbytes());
  ASSERT_GT(layer_bytes, 0);

  model::text::TextGrads grads = model::text::TextGrads::zeros_like(m.weights());
  ShardedLayers fsdp(m.weights(), grads, par.dp());
  EXPECT_EQ(fsdp.full_bytes(), layer_bytes);
  for (const auto& [name, t] : m.weights().named)
    if (is_layer_name(name, layers)) EXPECT_FALSE(t.defined()) << name << " still whole";
  Measured measured(fsdp, m.weights());
  topt.layer_params = &measured;

  double lm = 0, objective = 0;
  for (int64_t k = 0; k < kPacksPerRank; ++k) {
    const auto r =
        model::text::forward_backward(m, all[size_t(me * kPacksPerRank + k)], topt, grads);
    lm += r.backward.lm_loss_sum;
    objective += r.backward.objective();
  }
  // Forward, recompute and backward gathers; one reduction per layer per pack.
  const int64_t recomputed = std::count(topt.activations.begin(), topt.activations.end(),
                                        model::text::ActivationPolicy::recompute);
  EXPECT_EQ(measured.gathers, kPacksPerRank * (2 * layers));
  EXPECT_EQ(measured.reductions, kPacksPerRank * layers);
  EXPECT_GT(recomputed, 0);
  EXPECT_LT(recomputed, layers);

  // Losses: the sums over the ranks.
  std::vector<double> sums = {lm, objective};
  par.dp().all_reduce_sum(sums);
  EXPECT_NEAR(sums[0] / topt.lm_denominator, ref_lm / topt.lm_denominator, 1e-6);
  EXPECT_NEAR(sums[1], ref_objective, 1e-6);

  // Gradients: the layers' buffers were handed to the slices (zero here); the replicated ones
  // are summed over the ranks as plain data parallel does.
  for (auto& [name, g] : grads.named) {
    if (is_layer_name(name, layers)) {
      const std::vector<double> v = g.to_doubles();
      EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](double x) { return x == 0; })) << name;
    } else {
      par.dp().all_reduce(g);
    }
  }
  fsdp.gather_gradients();
  ASSERT_EQ(grads.named.size(), ref_grads.named.size());
  for (size_t i = 0; i < grads.named.size(); ++i)
    EXPECT_LE(rel_diff(grads.named[i].second, ref_grads.named[i].second), 1e-6)
        << grads.named[i].first;

  // Memory between layers: this rank's slices only (1/P of the layers, plus padding of fewer
  // than P elements per layer); while a layer runs, that layer's buffer on top.
  const int64_t padding = layers * ranks * int64_t(dtype_size(m.dtype()));
  EXPECT_GE(measured.between, layer_bytes / ranks);
  EXPECT_LE(measured.between, layer_bytes / ranks + padding);
  EXPECT_GT(measured.during, measured.between);
  EXPECT_EQ(fsdp.resident_bytes(), measured.between);
  ::testing::Test::RecordProperty("layer_bytes", std::to_string(layer_bytes));
  ::testing::Test::RecordProperty("resident_between_layers", std::to_string(measured.between));
  ::testing::Test::RecordProperty("resident_during_layer", std::to_string(measured.during));

  // The evaluation forward gathers and releases too, and computes the same logits.
  model::text::ForwardOptions fo;
  fo.layer_params = &fsdp;
  const model::text::ForwardOutput eval = m.forward(all[0], fo);
  EXPECT_EQ(rel_diff(eval.logits, ref_eval.logits), 0.0);
  EXPECT_EQ(eval.loss(), ref_eval.loss());
  EXPECT_LE(fsdp.resident_bytes(), layer_bytes / ranks + padding);
}

}  // namespace
}  // namespace glmtune::dist

int main(int argc, char** argv) { return glmtune::dist::testing::run_all_tests(argc, argv); }

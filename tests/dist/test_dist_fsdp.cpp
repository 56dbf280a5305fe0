// Fully sharded data parallel under mpirun (dist/fsdp.h) against the single-process step: with
// the decoder layers' parameters held in slices over the dp group, gathered per layer (the next
// layer prefetched) and released after, and each layer's gradient buffers existing only around
// its backward before being reduce-scattered into slices, one step's summed losses and every
// gradient (slices gathered back) equal what one process computes from all the packs; each rank
// holds about 1/P of the decoder-layer weights and gradients, at most two gathered layers at a
// time (measured from the storage that is still alive, not computed from the layout). The
// optimizer on the slices updates exactly as the unsharded AdamW, keeps 1/P of its state per
// rank, and its state gathers back to the unsharded format and loads from it. With expert
// parallelism the routed-expert slices stay out of the layout, and a start-up, resume and save as
// the trainer does them write the single process's files.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../unit/support/same_files.h"
#include "../unit/support/temp_dir.h"
#include "dist_support.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/dist/expert_shards.h"
#include "glmtune/dist/fsdp.h"
#include "glmtune/dist/sharded_optimizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/state.h"
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

// Passes every call on and measures what is resident: parameters right after each release
// (between layers: the next layer may be in flight already) and while a layer runs with the next
// one prefetched; gradients right after each reduction (between layers) and while a layer's
// buffers exist.
class Measured final : public model::text::LayerParamProvider {
 public:
  Measured(ShardedLayers& inner, const model::text::TextWeights& w) : inner_(inner), w_(w) {}
  void gather(int64_t layer) override {
    inner_.gather(layer);
    EXPECT_TRUE(w_.layers[size_t(layer)].input_layernorm.defined()) << "layer " << layer;
    during = std::max(during, inner_.resident_bytes());
    ++gathers;
  }
  void prefetch(int64_t layer) override {
    inner_.prefetch(layer);
    during = std::max(during, inner_.resident_bytes());
    ++prefetches;
  }
  void release(int64_t layer) override {
    inner_.release(layer);
    EXPECT_FALSE(w_.layers[size_t(layer)].input_layernorm.defined()) << "layer " << layer;
    between = std::max(between, inner_.resident_bytes());
    between_least = std::min(between_least, inner_.resident_bytes());
  }
  void allocate_gradients(int64_t layer) override {
    inner_.allocate_gradients(layer);
    grad_during = std::max(grad_during, inner_.gradient_bytes());
  }
  void reduce_gradients(int64_t layer) override {
    inner_.reduce_gradients(layer);
    grad_between = std::max(grad_between, inner_.gradient_bytes());
    ++reductions;
  }
  int64_t between = 0, between_least = std::numeric_limits<int64_t>::max(), during = 0;
  int64_t grad_between = 0, grad_during = 0;
  int64_t gathers = 0, prefetches = 0, reductions = 0;

 private:
  ShardedLayers& inner_;
  const model::text::TextWeights& w_;
};

// Bytes of the decoder-layer tensors of `named`, per layer.
std::vector<int64_t> bytes_per_layer(const std::vector<std::pair<std::string, Tensor>>& named,
                                     int64_t layers) {
  std::vector<int64_t> out(size_t(layers), 0);
  for (const auto& [name, t] : named)
    for (int64_t l = 0; l < layers; ++l) {
      const std::string p = model::text::layer_prefix(l);
      if (name.compare(0, p.size(), p) == 0) out[size_t(l)] += int64_t(t.nbytes());
    }
  return out;
}

// The source of a model that holds every decoder-layer tensor whole: nothing is deferred, so each
// rank copies its slices from the model's tensors and `read` is never called.
LayerSource whole_tensors() {
  return {[](const std::string&) -> std::optional<Shape> { return std::nullopt; }, nullptr};
}

// The pieces of the whole tensors `params` (storage dtype), copied: the optimizer updates its
// pieces in place, and the tensors must keep their values.
ShardedLayerAdamW::PieceReader copy_pieces(const std::vector<train::NamedParam>& params) {
  std::map<std::string, Tensor> by_name;
  for (const train::NamedParam& p : params) by_name.emplace(p.name, p.value);
  return [by_name](const std::string& name, int64_t begin, int64_t count) {
    return by_name.at(name).reshape({-1}).narrow(0, begin, count).clone();
  };
}

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

  // The decoder-layer bytes of the whole model, from the weights and gradients themselves.
  const std::vector<int64_t> per_layer = bytes_per_layer(m.weights().named, layers);
  int64_t layer_bytes = 0, largest_pair = 0;
  for (int64_t l = 0; l < layers; ++l) {
    layer_bytes += per_layer[size_t(l)];
    if (l + 1 < layers)
      largest_pair = std::max(largest_pair, per_layer[size_t(l)] + per_layer[size_t(l + 1)]);
  }
  ASSERT_GT(layer_bytes, 0);
  int64_t layer_grad_bytes = 0;
  for (int64_t b : bytes_per_layer(ref_grads.named, layers)) layer_grad_bytes += b;
  ASSERT_GT(layer_grad_bytes, 0);

  model::text::TextGrads grads = model::text::TextGrads::zeros_like(m.weights());
  ShardedLayers fsdp(m.weights(), grads, par.dp(), whole_tensors());
  EXPECT_EQ(fsdp.full_bytes(), layer_bytes);
  EXPECT_EQ(fsdp.full_gradient_bytes(), layer_grad_bytes);
  for (const auto& [name, t] : m.weights().named)
    if (is_layer_name(name, layers)) EXPECT_FALSE(t.defined()) << name << " still whole";
  for (const auto& [name, g] : grads.named)
    if (is_layer_name(name, layers)) EXPECT_FALSE(g.defined()) << name << " gradient still whole";
  Measured measured(fsdp, m.weights());
  topt.layer_params = &measured;

  double lm = 0, objective = 0;
  for (int64_t k = 0; k < kPacksPerRank; ++k) {
    const auto r =
        model::text::forward_backward(m, all[size_t(me * kPacksPerRank + k)], topt, grads);
    lm += r.backward.lm_loss_sum;
    objective += r.backward.objective();
  }
  // Forward, recompute and backward gathers, each but the last of a loop prefetching the next
  // layer; one reduction per layer per pack.
  const int64_t recomputed = std::count(topt.activations.begin(), topt.activations.end(),
                                        model::text::ActivationPolicy::recompute);
  EXPECT_EQ(measured.gathers, kPacksPerRank * (2 * layers));
  EXPECT_EQ(measured.prefetches, kPacksPerRank * (2 * (layers - 1)));
  EXPECT_EQ(measured.reductions, kPacksPerRank * layers);
  EXPECT_GT(recomputed, 0);
  EXPECT_LT(recomputed, layers);

  // Losses: the sums over the ranks.
  std::vector<double> sums = {lm, objective};
  par.dp().all_reduce_sum(sums);
  EXPECT_NEAR(sums[0] / topt.lm_denominator, ref_lm / topt.lm_denominator, 1e-6);
  EXPECT_NEAR(sums[1], ref_objective, 1e-6);

  // Gradients: the layers' buffers are gone again; the replicated ones are summed over the ranks
  // as plain data parallel does, the layers' come back from the slices.
  std::map<std::string, Tensor> got;
  for (auto& [name, g] : grads.named) {
    if (is_layer_name(name, layers)) {
      EXPECT_FALSE(g.defined()) << name << " gradient outlived its reduction";
    } else {
      par.dp().all_reduce(g);
      got[name] = g;
    }
  }
  fsdp.gather_gradients([&](const std::string& name, const Tensor& g) {
    EXPECT_TRUE(got.emplace(name, g.clone()).second) << name << " twice";
  });
  ASSERT_EQ(got.size(), ref_grads.named.size());
  // Each pack's layer gradient is summed on its own and then added to the step's slice, where the
  // plain run adds every contribution into one buffer: an f32 regrouping, about 1e-8 of a
  // gradient, except for the few-element per-head and per-stream parameters whose sums over every
  // token cancel (mHC base and scale, dt_bias, A_log): a regrouping moves those by up to a few 1e-6
  // of themselves, depending on the CPU's rounding (1.3e-6 measured on one, under 1e-6 on another).
  for (const auto& [name, want] : ref_grads.named) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_LE(rel_diff(got.at(name), want), want.numel() >= 1024 ? 1e-6 : 1e-5) << name;
  }

  // Memory after the step: this rank's slices only (1/P of the layers, plus padding of fewer
  // than P elements per layer), which is also what is left after the last layer of each loop.
  // While a layer runs, that layer's buffer and the prefetched next one on top (the prefetch is
  // in flight: the pair is resident at once); between two layers the next one alone, never the
  // released one too.
  const int64_t slices = fsdp.resident_bytes();
  const int64_t padding = layers * ranks * int64_t(dtype_size(m.dtype()));
  const int64_t largest = *std::max_element(per_layer.begin(), per_layer.end());
  EXPECT_GE(slices, layer_bytes / ranks);
  EXPECT_LE(slices, layer_bytes / ranks + padding);
  EXPECT_EQ(measured.between_least, slices);
  EXPECT_GT(measured.between, slices);
  EXPECT_LE(measured.between, slices + largest + padding);
  EXPECT_GE(measured.during, slices + largest_pair);
  EXPECT_LE(measured.during, slices + largest_pair + 2 * padding);
  // Gradients: slices of the trained tensors only (the indexer and the router biases sit in flats
  // without gradients), 1/P of them up to the same padding, and one layer's buffer on top while
  // it is differentiated.
  EXPECT_EQ(measured.grad_between, fsdp.gradient_bytes());
  EXPECT_LT(fsdp.full_gradient_bytes(), fsdp.full_bytes());
  EXPECT_GE(measured.grad_between, fsdp.full_gradient_bytes() / ranks);
  EXPECT_LE(measured.grad_between, fsdp.full_gradient_bytes() / ranks + padding);
  EXPECT_GT(measured.grad_during, measured.grad_between);
  EXPECT_LE(measured.grad_during, measured.grad_between + largest + padding);
  ::testing::Test::RecordProperty("layer_bytes", std::to_string(layer_bytes));
  ::testing::Test::RecordProperty("layer_grad_bytes", std::to_string(layer_grad_bytes));
  ::testing::Test::RecordProperty("resident_slices", std::to_string(slices));
  ::testing::Test::RecordProperty("resident_between_layers", std::to_string(measured.between));
  ::testing::Test::RecordProperty("resident_during_layer", std::to_string(measured.during));
  ::testing::Test::RecordProperty("gradient_between_layers", std::to_string(measured.grad_between));
  ::testing::Test::RecordProperty("gradient_during_layer", std::to_string(measured.grad_during));

  // The evaluation forward gathers and releases too, and computes the same logits.
  model::text::ForwardOptions fo;
  fo.layer_params = &fsdp;
  const model::text::ForwardOutput eval = m.forward(all[0], fo);
  EXPECT_EQ(rel_diff(eval.logits, ref_eval.logits), 0.0);
  EXPECT_EQ(eval.loss(), ref_eval.loss());
  EXPECT_LE(fsdp.resident_bytes(), layer_bytes / ranks + padding);
}

// The optimizer on the slices against the unsharded AdamW on the whole decoder layers, fed the
// same gradients: the norm matches, the update is bit for bit the same (trained tensors in bf16
// and in f32 storage, frozen ones untouched), the state per rank is about 1/P and adds up to the
// unsharded state, and it gathers back to the unsharded format and loads from it.
TEST(DistFsdp, LayerOptimizerUpdatesTheSlicesAsTheUnshardedAdamW) {
  ParallelContext& par = *testing::world_context();
  const int ranks = par.dp().size(), me = par.dp().rank();
  ASSERT_GT(ranks, 1) << "run under mpirun with 2 or 4 ranks";
  test::TempDir dir("dist-fsdp-opt-" + std::to_string(par.rank()));
  model::InitOptions init;
  init.seed = 5;
  model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", init);
  const auto config = model::ModelConfig::from_file((dir / "tiny" / "config.json").string());
  model::ParamStore store =
      model::ParamStore::load(io::CheckpointReader::open(dir / "tiny"), config);
  train::make_params_writable(store);
  model::text::TextModel m(store);
  const int64_t layers = m.text().num_hidden_layers;
  std::vector<train::NamedParam> layer_params;
  for (train::NamedParam& p : train::named_params(store))
    if (is_layer_name(p.name, layers)) {
      p.trainable = model::text::is_trainable_param(p.name);
      layer_params.push_back(std::move(p));
    }
  std::set<DType> trained_dtypes;
  for (const train::NamedParam& p : layer_params)
    if (p.trainable) trained_dtypes.insert(p.value.dtype());
  EXPECT_EQ(trained_dtypes.size(), 2u) << "the tiny model stores trained tensors in bf16 and f32";

  model::text::TextGrads grads = model::text::TextGrads::zeros_like(m.weights());
  ShardedLayers fsdp(m.weights(), grads, par.dp(), whole_tensors());
  // A small clipping threshold: the clip coefficient below 1 enters every element.
  const train::AdamWConfig adamw{0.9, 0.95, 1e-8, 0.01, 0.1};
  ShardedLayerAdamW sharded(fsdp, copy_pieces(layer_params), adamw);
  // Before any step the slices hold the stored values.
  const std::vector<Tensor> before = [&] {
    std::vector<Tensor> v;
    for (const auto& p : layer_params) v.push_back(p.value.clone());
    return v;
  }();

  // The same random gradients on every rank: the whole tensors for the reference, this rank's
  // part of each in its gradient slice.
  std::mt19937_64 rng(99);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::map<std::string, Tensor> whole;
  for (const auto& p : layer_params) {
    if (!p.trainable) continue;
    std::vector<float> v(size_t(p.value.numel()));
    for (float& x : v) x = normal(rng);
    whole[p.name] = Tensor::from_vector(v, p.value.shape());
  }
  for (int64_t l = 0; l < fsdp.layers(); ++l)
    for (const ShardedLayers::Entry& e : fsdp.entries(l)) {
      if (!e.trained) continue;
      const int64_t begin = fsdp.slice_begin(l, e.flat), size = fsdp.slice(l, e.flat).numel();
      const int64_t lo = std::max(e.offset, begin), hi = std::min(e.offset + e.numel, begin + size);
      if (lo < hi)
        fsdp.gradient_slice(l, e.flat)
            .slice(0, lo - begin, hi - begin)
            .copy_(whole.at(e.name).view({e.numel}).slice(0, lo - e.offset, hi - e.offset));
    }
  train::AdamW reference(layer_params, adamw);
  std::vector<Tensor> ref_grads;
  for (const auto& p : layer_params) ref_grads.push_back(p.trainable ? whole.at(p.name) : Tensor());
  const double ref_norm = std::sqrt(reference.grad_sq_norm(ref_grads));
  const double norm = std::sqrt(par.dp().all_reduce_sum(sharded.grad_sq_norm()));
  EXPECT_NEAR(norm, ref_norm, 1e-12 * ref_norm);
  for (int step = 0; step < 2; ++step) {
    const train::StepReport want = reference.step(ref_grads, 1e-2, ref_norm);
    const train::StepReport got = sharded.step(1e-2, ref_norm);
    EXPECT_EQ(got.step, want.step);
    EXPECT_EQ(got.clip_coef, want.clip_coef);
    EXPECT_LT(want.clip_coef, 1.0);
  }
  EXPECT_EQ(sharded.step_count(), 2);

  // Weights: each tensor gathered whole from the slices equals the reference's (stored dtype,
  // converted exactly); the frozen tensors are still what they were. Every decoder-layer tensor is
  // held in the slices, and nothing else is.
  size_t held = 0;
  for (int64_t l = 0; l < fsdp.layers(); ++l) held += fsdp.entries(l).size();
  EXPECT_EQ(held, layer_params.size());
  for (size_t i = 0; i < layer_params.size(); ++i) {
    const train::NamedParam& p = layer_params[i];
    ASSERT_TRUE(fsdp.holds(p.name)) << p.name;
    const Tensor updated = fsdp.gather_tensor(p.name, 0);
    if (me == 0) {
      EXPECT_EQ(updated.shape(), p.value.shape()) << p.name;
      EXPECT_EQ(rel_diff(updated, p.value), 0.0) << p.name;
    }
    if (p.trainable)
      EXPECT_GT(rel_diff(p.value, before[i]), 0.0) << p.name << " was not updated";
    else
      EXPECT_EQ(rel_diff(p.value, before[i]), 0.0) << p.name << " is frozen";
  }

  // State: about 1/P per rank (fewer where a rank's range holds frozen tensors), adding up to the
  // unsharded state exactly.
  int64_t full_state = 0, layer_elements = 0;
  for (size_t i = 0; i < layer_params.size(); ++i) {
    layer_elements += layer_params[i].value.numel();
    if (!layer_params[i].trainable) continue;
    const int64_t n = layer_params[i].value.numel();
    full_state += n * int64_t(dtype_size(layer_params[i].value.dtype())) + 2 * n * 4 +
                  (layer_params[i].value.dtype() == DType::f32 ? 0 : n * 4);
  }
  const int64_t mine = sharded.state_bytes();
  EXPECT_EQ(par.dp().all_reduce_sum(mine), full_state);
  EXPECT_LE(mine, (layer_elements / ranks + layers) * 14);
  EXPECT_LT(mine, full_state / ranks + full_state / (4 * ranks) + 1) << "not about 1/P";
  ::testing::Test::RecordProperty("optimizer_state_bytes", std::to_string(mine));
  ::testing::Test::RecordProperty("optimizer_state_bytes_unsharded", std::to_string(full_state));

  // Checkpoint format: each tensor's state gathered whole on rank 0 is the reference's bit for bit;
  // saved in the unsharded format, a fresh sharded optimizer loads it back to the same pieces.
  const auto expect_reference_state = [&](const ShardedLayerAdamW& opt, const char* which) {
    for (size_t i = 0; i < layer_params.size(); ++i) {
      const train::NamedParam& p = layer_params[i];
      if (!p.trainable) continue;
      const std::array<Tensor, 3> state = opt.gather_state(p.name, 0);
      if (me != 0) continue;
      // No ASSERT here: the other ranks go on with the next gather.
      if (!std::all_of(state.begin(), state.end(), [&](const Tensor& t) {
            return t.defined() && t.numel() == p.value.numel();
          })) {
        ADD_FAILURE() << which << " " << p.name << ": the gathered state is not the whole tensor's";
        continue;
      }
      EXPECT_EQ(rel_diff(state[0], reference.master(i)), 0.0) << which << " " << p.name;
      EXPECT_EQ(rel_diff(state[1], reference.exp_avg(i)), 0.0) << which << " " << p.name;
      EXPECT_EQ(rel_diff(state[2], reference.exp_avg_sq(i)), 0.0) << which << " " << p.name;
    }
  };
  expect_reference_state(sharded, "trained");
  reference.save(dir / "reference-optimizer");
  ShardedLayerAdamW restored(fsdp, copy_pieces(layer_params), adamw);
  restored.load(train::SavedAdamWState::open(dir / "reference-optimizer"));
  EXPECT_EQ(restored.step_count(), 2);
  EXPECT_EQ(restored.state_bytes(), mine);
  expect_reference_state(restored, "reloaded");
}

// Bytes of the distinct storages of the named tensors that `keep` selects and that own their memory
// (a view of a mapped checkpoint is not allocated).
int64_t owned_bytes(const std::vector<std::pair<std::string, Tensor>>& named,
                    const std::function<bool(const std::string&)>& keep,
                    std::set<const Storage*>& seen) {
  int64_t bytes = 0;
  for (const auto& [name, t] : named)
    if (t.defined() && keep(name) && t.storage()->owns_memory() &&
        seen.insert(t.storage().get()).second)
      bytes += int64_t(t.storage()->bytes());
  return bytes;
}

// Tensor memory allocated now and the most allocated since the last mark, relative to the mark.
class HostBytes {
 public:
  HostBytes() { mark(); }
  void mark() {
    host_allocator().reset_peak();
    base_ = int64_t(host_allocator().stats().allocated);
  }
  int64_t held() const { return int64_t(host_allocator().stats().allocated) - base_; }
  int64_t peak() const { return int64_t(host_allocator().stats().peak_allocated) - base_; }

 private:
  int64_t base_ = 0;
};

// Start-up, resume and checkpoint save of fully sharded layers, streamed, against the whole
// tensors they used to go through. A "run" is saved by one process (the whole parameter store and
// the unsharded AdamW with a non-trivial state, written into each rank's own directory); then:
//   start-up: every rank loads the store with the decoder layers deferred and reads only its
//   slices'
//     elements: its tensor memory stays within what it keeps (the replicated tensors, its slices,
//     its optimizer pieces) plus one tensor, where the whole load held every decoder layer at once;
//   resume: each rank reads its pieces of the saved optimizer state by ranges, allocating nothing
//     beyond the state it already holds, where reading the whole state held all of it;
//   save: rank 0 writes the model and the optimizer state from tensors gathered one at a time, its
//     extra memory a few times the largest tensor, and the files are byte for byte the ones the
//     single process wrote.
// The memory is measured by the host allocator's accounting of live tensor bytes.
TEST(DistFsdp, StartUpResumeAndSaveHoldSlicesAndOneTensorNotTheModel) {
  ParallelContext& par = *testing::world_context();
  Communicator& dp = par.dp();
  const int ranks = dp.size(), me = dp.rank();
  ASSERT_GT(ranks, 1) << "run under mpirun with 2 or 4 ranks";
  test::TempDir dir("dist-fsdp-stream-" + std::to_string(par.rank()));
  model::InitOptions init;
  init.seed = 13;
  model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", init);
  const auto config = model::ModelConfig::from_file((dir / "tiny" / "config.json").string());
  const int64_t layers = config.text().num_hidden_layers;
  const train::AdamWConfig adamw{0.9, 0.95, 1e-8, 0.01, 1.0};
  const auto in_layers = [&](const std::string& name) { return is_layer_name(name, layers); };
  const auto trained = [](const model::InternalParam& p) {
    return p.trainable && model::text::is_trainable_param(p.name);
  };
  const fs::path saved_model = dir / "ref" / "model", saved_optimizer = dir / "ref" / "optimizer";

  // The single process's checkpoint: random moments and masters, the weights their rounding.
  int64_t whole_state_bytes = 0, largest_tensor = 0;
  std::vector<std::pair<std::string, Shape>> trained_shapes;
  {
    model::ParamStore store =
        model::ParamStore::load(io::CheckpointReader::open(dir / "tiny"), config);
    train::make_params_writable(store);
    std::vector<train::NamedParam> params = train::named_params(store);
    for (train::NamedParam& p : params) p.trainable = trained(store.param(p.name));
    train::AdamW full(params, adamw);
    std::mt19937_64 rng(17);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    const auto random = [&](const Shape& shape, bool positive) {
      std::vector<float> v(size_t(shape_numel(shape)));
      for (float& x : v) x = positive ? std::abs(normal(rng)) : normal(rng);
      return Tensor::from_vector(v, shape);
    };
    for (size_t i = 0; i < params.size(); ++i) {
      largest_tensor = std::max(largest_tensor, params[i].value.numel());
      if (!params[i].trainable) continue;
      const Shape& shape = params[i].value.shape();
      const Tensor master = random(shape, false);
      full.set_state(i, master, random(shape, false), random(shape, true));
      trained_shapes.emplace_back(params[i].name, shape);
    }
    full.set_step_count(5);
    whole_state_bytes = full.state_bytes();
    store.save(saved_model);
    full.save(saved_optimizer);
  }

  // The whole load as it was: every rank built the whole model before keeping its slices.
  HostBytes bytes;
  int64_t whole_start_up = 0;
  std::vector<Tensor> reference_slices;
  {
    model::ParamStore store =
        model::ParamStore::load(io::CheckpointReader::open(saved_model), config);
    train::make_params_writable(store);
    model::text::TextModel m(store);
    model::text::TextGrads grads = model::text::TextGrads::zeros_like(m.weights());
    ShardedLayers fsdp(m.weights(), grads, dp, whole_tensors());
    std::vector<train::NamedParam> layer_params = train::named_params(store);
    std::erase_if(layer_params, [&](const train::NamedParam& p) { return !in_layers(p.name); });
    ShardedLayerAdamW layer_optimizer(fsdp, copy_pieces(layer_params), adamw);
    whole_start_up = bytes.peak();
    for (int64_t l = 0; l < fsdp.layers(); ++l)
      reference_slices.push_back(fsdp.slice(l, 0).clone());
  }

  // Streamed start-up, as the trainer does it.
  bytes.mark();
  std::optional<io::CheckpointReader> reader = io::CheckpointReader::open(saved_model);
  model::ParamStore store =
      model::ParamStore::load(*reader, config, std::nullopt, [&](const std::string& name) {
        return in_layers(name) && !name.ends_with("e_score_correction_bias");
      });
  train::make_params_writable(store);
  model::text::TextModel m(store);
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(m.weights());
  const auto read_piece = [&](const std::string& name, int64_t begin, int64_t count) {
    const model::InternalParam& p = store.param(name);
    return p.deferred ? store.read_elements(*reader, name, begin, count)
                      : p.value.reshape({-1}).narrow(0, begin, count).clone();
  };
  ShardedLayers fsdp(m.weights(), grads, dp,
                     LayerSource{[&](const std::string& name) -> std::optional<Shape> {
                                   const model::InternalParam& p = store.param(name);
                                   return p.deferred ? std::optional(p.shape) : std::nullopt;
                                 },
                                 read_piece});
  ShardedLayerAdamW layer_optimizer(fsdp, read_piece, adamw);
  std::map<std::string, DType> dropped;
  for (const model::InternalParam& p : store.params())
    if (p.deferred) dropped.emplace(p.name, p.value.dtype());
  for (const auto& [name, dtype] : dropped) store.get(name) = Tensor();
  reader.reset();
  const int64_t start_up_peak = bytes.peak(), start_up_held = bytes.held();

  // What a rank keeps: the replicated tensors (store, model, gradients) and its decoder slices.
  std::set<const Storage*> seen;
  std::vector<std::pair<std::string, Tensor>> stored;
  for (const model::InternalParam& p : store.params()) stored.emplace_back(p.name, p.value);
  const auto everything = [](const std::string&) { return true; };
  const int64_t replicated = owned_bytes(stored, everything, seen) +
                             owned_bytes(m.weights().named, everything, seen) +
                             owned_bytes(grads.named, everything, seen);
  const int64_t slices =
      fsdp.resident_bytes() + fsdp.gradient_bytes() + layer_optimizer.state_bytes();
  int64_t largest_layer_tensor = 0, placeholders = 0;
  for (int64_t l = 0; l < layers; ++l)
    for (const ShardedLayers::Entry& e : fsdp.entries(l)) {
      largest_layer_tensor = std::max(largest_layer_tensor, e.numel * 4);
      placeholders += 3 * 8;  // the store's, the model's and the gradient's placeholder, at most
    }
  size_t layer_tensors = 0, biases = 0;
  for (const auto& [name, t] : m.weights().named) {
    layer_tensors += in_layers(name);
    biases += in_layers(name) && name.ends_with("e_score_correction_bias");
  }
  EXPECT_EQ(dropped.size() + biases, layer_tensors)
      << "every decoder-layer tensor but the router biases is deferred";
  // Held after start-up: exactly what is kept (the allocator counts requested bytes).
  EXPECT_EQ(start_up_held, replicated + slices);
  // The peak: what is kept, the placeholders, and one tensor's piece in flight.
  const int64_t start_up_bound = replicated + slices + placeholders + largest_layer_tensor;
  EXPECT_LE(start_up_peak, start_up_bound);
  EXPECT_GT(whole_start_up, start_up_bound);
  EXPECT_GE(whole_start_up - replicated, fsdp.full_bytes() + fsdp.full_gradient_bytes())
      << "the whole load held every decoder layer's weights and gradients (f32) at once";
  EXPECT_LE(fsdp.resident_bytes(), fsdp.full_bytes() / ranks + layers * ranks * 4);
  // The slices read piece by piece are the whole load's, bit for bit.
  for (int64_t l = 0; l < layers; ++l)
    EXPECT_EQ(rel_diff(fsdp.slice(l, 0), reference_slices[size_t(l)]), 0.0) << "layer " << l;

  // Resume: the replicated shards and the layer pieces read by ranges, then the same state loaded
  // through a whole unsharded optimizer as it was.
  std::vector<train::NamedParam> replicated_params = train::named_params(store);
  std::erase_if(replicated_params, [&](const train::NamedParam& p) { return in_layers(p.name); });
  for (train::NamedParam& p : replicated_params) p.trainable = trained(store.param(p.name));
  ShardedAdamW replicated_optimizer(replicated_params, adamw, dp);
  bytes.mark();
  {
    const train::SavedAdamWState saved = train::SavedAdamWState::open(saved_optimizer);
    saved.check(trained_shapes);
    replicated_optimizer.load(saved);
    layer_optimizer.load(saved);
  }
  const int64_t resume_peak = bytes.peak(), resume_held = bytes.held();
  EXPECT_EQ(resume_held, 0);
  EXPECT_LE(resume_peak, 4096) << "a ranged read allocates no tensor";
  int64_t whole_resume = 0;
  {
    bytes.mark();
    std::vector<train::NamedParam> whole_params;
    for (const auto& [name, shape] : trained_shapes)
      whole_params.push_back(
          {name,
           Tensor::empty(shape, store.param(name).value.defined() ? store.param(name).value.dtype()
                                                                  : dropped.at(name)),
           true});
    train::AdamW whole(whole_params, adamw);
    whole.load(saved_optimizer);
    whole_resume = bytes.peak();
  }
  int64_t trained_elements = 0;
  for (const auto& [name, shape] : trained_shapes) trained_elements += shape_numel(shape);
  EXPECT_GE(whole_resume, 12 * trained_elements) << "masters and moments of every tensor";

  // Save: the weights gathered tensor by tensor into rank 0's writer, then the optimizer state.
  const fs::path out = dir / "streamed";
  const model::ParamStore::WholeValue whole_value = [&](const model::InternalParam& p) -> Tensor {
    if (p.value.defined()) return p.value;
    const Tensor whole = fsdp.gather_tensor(p.name, 0);
    if (me != 0) return Tensor();
    Tensor value = Tensor::empty(whole.shape(), dropped.at(p.name));
    value.copy_(whole);
    return value;
  };
  const train::WholeOptimizerState whole_state =
      [&](const std::string& name) -> std::array<Tensor, 3> {
    return in_layers(name) ? layer_optimizer.gather_state(name, 0)
                           : replicated_optimizer.gather_state(name, 0);
  };
  ASSERT_EQ(layer_optimizer.step_count(), 5);
  bytes.mark();
  if (me == 0) {
    store.save(out / "model", whole_value);
    train::save_optimizer_state(out / "optimizer", trained_shapes, layer_optimizer.step_count(),
                                whole_state);
  } else {
    store.visit_for_save(whole_value);
    train::visit_optimizer_state(trained_shapes, whole_state);
  }
  const int64_t save_peak = bytes.peak();
  // One tensor's three state vectors (f32) gathered whole, and a little: a small multiple of the
  // largest tensor, whatever the model's size or the number of ranks.
  const int64_t save_bound = 4 * largest_tensor * 4;
  EXPECT_LE(save_peak, save_bound);
  EXPECT_LT(save_bound, whole_state_bytes) << "the bound must not allow the whole state";
  if (me == 0) {
    for (const char* part : {"model", "optimizer"})
      test::expect_same_files(out / part, dir / "ref" / part);
  }
  ::testing::Test::RecordProperty("whole_start_up_peak", std::to_string(whole_start_up));
  ::testing::Test::RecordProperty("streamed_start_up_peak", std::to_string(start_up_peak));
  ::testing::Test::RecordProperty("streamed_start_up_held", std::to_string(start_up_held));
  ::testing::Test::RecordProperty("whole_resume_peak", std::to_string(whole_resume));
  ::testing::Test::RecordProperty("streamed_resume_peak", std::to_string(resume_peak));
  ::testing::Test::RecordProperty("streamed_save_peak", std::to_string(save_peak));
  if (par.is_root())
    std::printf(
        "fsdp over %d ranks, rank 0: start-up peak %lld bytes whole vs %lld streamed (held %lld: "
        "%lld replicated, %lld slices); resume peak %lld whole vs %lld ranged; save peak %lld "
        "(largest tensor %lld f32 bytes, whole optimizer state %lld)\n",
        ranks, (long long)whole_start_up, (long long)start_up_peak, (long long)start_up_held,
        (long long)replicated, (long long)slices, (long long)whole_resume, (long long)resume_peak,
        (long long)save_peak, (long long)largest_tensor * 4, (long long)whole_state_bytes);
}

// A single process's checkpoint of `model_dir` under `out` (model/, optimizer/): random masters
// and moments (the weights their rounding) at step 5. Returns the trained tensors' whole shapes.
std::vector<std::pair<std::string, Shape>> write_trained_checkpoint(
    const fs::path& model_dir, const model::ModelConfig& config, const train::AdamWConfig& adamw,
    const fs::path& out) {
  model::ParamStore store = model::ParamStore::load(io::CheckpointReader::open(model_dir), config);
  train::make_params_writable(store);
  std::vector<train::NamedParam> params = train::named_params(store);
  for (train::NamedParam& p : params)
    p.trainable = store.param(p.name).trainable && model::text::is_trainable_param(p.name);
  train::AdamW full(params, adamw);
  std::mt19937_64 rng(23);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const auto random = [&](const Shape& shape, bool positive) {
    std::vector<float> v(size_t(shape_numel(shape)));
    for (float& x : v) x = positive ? std::abs(normal(rng)) : normal(rng);
    return Tensor::from_vector(v, shape);
  };
  std::vector<std::pair<std::string, Shape>> trained;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].trainable) continue;
    const Shape& shape = params[i].value.shape();
    full.set_state(i, random(shape, false), random(shape, false), random(shape, true));
    trained.emplace_back(params[i].name, shape);
  }
  full.set_step_count(5);
  store.save(out / "model");
  full.save(out / "optimizer");
  return trained;
}

// Fully sharded layers with expert parallelism (ep = 2 over dp = 2 or 4), started, resumed and
// saved as the trainer does: each rank loads its experts' slices whole and defers every other
// decoder-layer tensor, the layout leaves the expert slices out (they stay in the model and the
// store, trained by the expert optimizer over edp), each optimizer reads its pieces of a single
// process's saved state, and the streamed save (decoder-layer tensors gathered over dp, expert
// slices over ep, their states over dp, edp and ep) writes byte for byte the single process's
// files.
TEST(DistFsdp, WithExpertSlicesResumeAndSaveGiveTheSingleProcessFiles) {
  ParallelOptions options;
  options.ep_size = 2;
  options.timeout_s = 300;
  const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
  ASSERT_EQ(par->sizes().ep, 2);
  Communicator& dp = par->dp();
  test::TempDir dir("dist-fsdp-ep-" + std::to_string(par->rank()));
  model::InitOptions init;
  init.seed = 19;
  model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", init);
  const auto config = model::ModelConfig::from_file((dir / "tiny" / "config.json").string());
  const int64_t layers = config.text().num_hidden_layers;
  const train::AdamWConfig adamw{0.9, 0.95, 1e-8, 0.01, 1.0};
  const auto in_layers = [&](const std::string& name) { return is_layer_name(name, layers); };
  const std::vector<std::pair<std::string, Shape>> trained_shapes =
      write_trained_checkpoint(dir / "tiny", config, adamw, dir / "ref");

  const ExpertParallel experts(par->ep(), config.text().n_routed_experts, "test");
  std::optional<io::CheckpointReader> reader = io::CheckpointReader::open(dir / "ref" / "model");
  model::ParamStore store =
      model::ParamStore::load(*reader, config, local_range(experts), [&](const std::string& name) {
        return in_layers(name) && !name.ends_with("e_score_correction_bias") &&
               !model::is_fused_expert_tensor(name);
      });
  train::make_params_writable(store);
  const LocalExperts local(store, experts);
  model::text::TextModel m(store);
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(m.weights());
  const auto read_piece = [&](const std::string& name, int64_t begin, int64_t count) {
    const model::InternalParam& p = store.param(name);
    return p.deferred ? store.read_elements(*reader, name, begin, count)
                      : p.value.reshape({-1}).narrow(0, begin, count).clone();
  };
  ShardedLayers fsdp(
      m.weights(), grads, dp,
      LayerSource{[&](const std::string& name) -> std::optional<Shape> {
                    const model::InternalParam& p = store.param(name);
                    return p.deferred ? std::optional(p.shape) : std::nullopt;
                  },
                  read_piece, [&](const std::string& name) { return local.holds(name); }});
  ShardedLayerAdamW layer_optimizer(fsdp, read_piece, adamw);
  std::map<std::string, DType> dropped;
  for (const model::InternalParam& p : store.params())
    if (p.deferred) dropped.emplace(p.name, p.value.dtype());
  for (const auto& [name, dtype] : dropped) store.get(name) = Tensor();
  reader.reset();
  // The expert slices are the only decoder-layer tensors left whole in the model, slice-sized, with
  // slice-sized gradient buffers; the layout holds every other one.
  int64_t expert_tensors = 0;
  for (const auto& [name, t] : m.weights().named) {
    if (!in_layers(name)) continue;
    EXPECT_EQ(t.defined(), local.holds(name)) << name;
    EXPECT_EQ(fsdp.holds(name), !local.holds(name)) << name;
    if (!local.holds(name)) continue;
    ++expert_tensors;
    EXPECT_EQ(t.size(0), experts.local_experts()) << name;
    const Tensor* g = grads.find(name);
    EXPECT_TRUE(g != nullptr && g->defined() && g->shape() == t.shape()) << name;
  }
  EXPECT_GT(expert_tensors, 0);

  // Resume: every optimizer reads its pieces of the single process's state.
  std::vector<train::NamedParam> replicated_params = train::named_params(store);
  std::erase_if(replicated_params, [&](const train::NamedParam& p) {
    return in_layers(p.name) || local.holds(p.name);
  });
  for (train::NamedParam& p : replicated_params)
    p.trainable = store.param(p.name).trainable && model::text::is_trainable_param(p.name);
  ShardedAdamW replicated_optimizer(replicated_params, adamw, dp);
  ExpertAdamW expert_optimizer(local, adamw, par->edp());
  {
    const train::SavedAdamWState saved = train::SavedAdamWState::open(dir / "ref" / "optimizer");
    saved.check(trained_shapes);
    replicated_optimizer.load(saved);
    layer_optimizer.load(saved);
    expert_optimizer.load(saved);
  }

  // Save as the trainer does: rank 0 writes, the others run the same gathers.
  const bool root = par->is_root();
  const fs::path out = dir / "streamed";
  const model::ParamStore::WholeValue whole_value = [&](const model::InternalParam& p) -> Tensor {
    if (local.holds(p.name)) return par->edp().rank() == 0 ? local.gather_one(p.name) : Tensor();
    if (p.value.defined()) return p.value;
    const Tensor whole = fsdp.gather_tensor(p.name, 0);
    if (!root) return Tensor();
    Tensor value = Tensor::empty(whole.shape(), dropped.at(p.name));
    value.copy_(whole);
    return value;
  };
  const train::WholeOptimizerState whole_state =
      [&](const std::string& name) -> std::array<Tensor, 3> {
    if (fsdp.holds(name)) return layer_optimizer.gather_state(name, 0);
    if (local.holds(name)) return expert_optimizer.gather_state(name);
    return replicated_optimizer.gather_state(name, 0);
  };
  if (root) {
    store.save(out / "model", whole_value);
    train::save_optimizer_state(out / "optimizer", trained_shapes, layer_optimizer.step_count(),
                                whole_state);
    for (const char* part : {"model", "optimizer"})
      test::expect_same_files(out / part, dir / "ref" / part);
  } else {
    store.visit_for_save(whole_value);
    train::visit_optimizer_state(trained_shapes, whole_state);
  }
}

}  // namespace
}  // namespace glmtune::dist

int main(int argc, char** argv) { return glmtune::dist::testing::run_all_tests(argc, argv); }

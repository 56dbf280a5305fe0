// One data-parallel training step under mpirun against the single-process step: the packs of the
// step are split over the ranks (the step's label counts as denominators, gradients summed), and
// the summed loss terms, every parameter gradient, the expert loads and the sharded optimizer's
// update equal what one process computes from all the packs. The same with the routed experts split
// over ep groups of 2 (expert parallelism): each rank loads and holds its slice of the experts
// only, tokens travel to their experts' ranks and back, a slice's gradient (summed over the ranks
// holding it) equals the same experts' single-process gradient, and the slices' optimizer (sharded
// over those ranks) gives the update of AdamW on the whole; and each rank's expert weight, gradient
// and optimizer bytes are its share of the whole. With fully sharded decoder layers on top, the
// layers' other tensors in slices over dp and the expert slices left out of them: the same step,
// and the slices at 1/dp of the layers, the experts at 1/E.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
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
#include "glmtune/base/error.h"
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
using dist_test::run_packs;
using dist_test::Step;
using model::text::PackInput;

constexpr int64_t kPacksPerRank = 2;

// `experts`: the routed experts to load (an expert-parallel rank's slice); nullopt for all.
model::ParamStore load_store(const fs::path& dir,
                             std::optional<model::ExpertRange> experts = std::nullopt) {
  const auto config = model::ModelConfig::from_file((dir / "config.json").string());
  model::ParamStore store =
      model::ParamStore::load(io::CheckpointReader::open(dir), config, experts);
  train::make_params_writable(store);
  return store;
}

std::vector<train::NamedParam> trainable(const model::ParamStore& store) {
  std::vector<train::NamedParam> params = train::named_params(store);
  for (auto& p : params)
    if (!model::text::is_trainable_param(p.name)) p.trainable = false;
  return params;
}

// The parameters of `params` (trainable ones) with their gradients in `grads` found by name.
std::vector<Tensor> grad_list(const model::text::TextGrads& grads,
                              const std::vector<train::NamedParam>& params) {
  std::vector<Tensor> out(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].trainable) out[i] = *grads.find(params[i].name);
  return out;
}

bool is_layer_name(const std::string& name, int64_t layers) {
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = model::text::layer_prefix(l);
    if (name.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

// One step on `par`: data parallel over every rank, and with `ep_size` > 1 the routed experts
// split over the ep groups, each rank holding its slice only. With `fsdp` the decoder layers'
// other tensors are held in slices over dp (dist/fsdp.h) while the expert slices stay whole on
// their ep rank, and their optimizer trains the slices.
void check_one_step(ParallelContext& par, int64_t ep_size, bool fsdp = false) {
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
  // With fsdp each pack's decoder-layer gradient is summed in a buffer of its own, reduce-scattered
  // and then added to the step's slice, where one process adds every pack into one buffer: an f32
  // regrouping. Where per-token terms cancel (the mHC scale gradients) it moves a gradient by about
  // 1e-6 of its largest element, no more than the single-process f32 gradient is itself away from
  // the f64 one (plain fsdp moves these exactly as much). A gradient past 1e-6 is therefore held to
  // the sequence-parallel bar (test_dist_sp.cpp): against the f64 gradient of the same step, within
  // 3× the single-process f32 run's largest error.
  model::text::TextGrads exact;
  double ref_error = 0;
  if (fsdp) {
    const model::text::TextModel wide(store, model::text::TextModelOptions{DType::f64});
    exact = model::text::TextGrads::zeros_like(wide.weights());
    run_packs(wide, all, topt, exact);
    for (size_t i = 0; i < ref_grads.named.size(); ++i)
      ref_error = std::max(ref_error, rel_diff(ref_grads.named[i].second, exact.named[i].second));
    EXPECT_LT(ref_error, 1e-4);
  }

  // This rank's packs, then the sums over the ranks. With expert parallelism this rank's model
  // holds its slice of the routed experts only (weights and gradient buffers).
  const std::vector<PackInput> mine(all.begin() + me * kPacksPerRank,
                                    all.begin() + (me + 1) * kPacksPerRank);
  std::optional<ExpertParallel> experts;
  if (ep_size > 1) experts.emplace(par.ep(), m.text().n_routed_experts, "test");
  model::ParamStore my_store =
      load_store(dir / "tiny", experts ? std::optional(local_range(*experts)) : std::nullopt);
  std::optional<LocalExperts> local;
  if (experts) {
    local.emplace(my_store, *experts);
    topt.expert_dispatch = &*experts;
  }
  model::text::TextModel my_model(my_store);
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(my_model.weights());
  const auto is_slice = [&](const std::string& name) { return local && local->holds(name); };
  const int64_t num_layers = m.text().num_hidden_layers;
  int64_t routed_bytes = 0;
  for (const auto& [name, t] : my_model.weights().named)
    if (model::is_fused_expert_tensor(name)) routed_bytes += int64_t(t.nbytes());
  std::optional<ShardedLayers> layers;
  if (fsdp) {
    layers.emplace(
        my_model.weights(), grads, par.dp(),
        LayerSource{[](const std::string&) -> std::optional<Shape> { return std::nullopt; },
                    nullptr, is_slice});
    topt.layer_params = &*layers;
    // The expert slices stay whole in the model; every other decoder-layer tensor is in slices.
    for (const auto& [name, t] : my_model.weights().named)
      if (is_layer_name(name, num_layers)) EXPECT_EQ(t.defined(), is_slice(name)) << name;
  }
  Step got = run_packs(my_model, mine, topt, grads);
  if (local) {
    // Every MoE layer's expert weights and gradients (decoder and MTP layers) are the slice.
    int64_t expert_tensors = 0;
    for (const auto& [name, g] : grads.named) {
      if (!model::is_fused_expert_tensor(name)) continue;
      ++expert_tensors;
      EXPECT_TRUE(is_slice(name)) << name;
      EXPECT_EQ(g.size(0), experts->local_experts()) << name;
    }
    int64_t moe_layers = 0;
    for (const auto& l : my_model.weights().layers)
      if (l.mlp == model::MlpKind::sparse) ++moe_layers;
    EXPECT_EQ(expert_tensors, 2 * (moe_layers + (my_model.has_mtp() ? 1 : 0)));
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

  // Every gradient, summed over the ranks holding it: a replicated tensor's over every rank, an
  // expert slice's over the edp group (the other ranks hold other experts), compared with the same
  // experts of the single-process gradient.
  // With fsdp the decoder layers' gradients come back from their slices, reduced over dp already.
  ASSERT_FALSE(grads.named.empty());
  std::map<std::string, Tensor> summed;
  for (const auto& [name, local_grad] : grads.named) {
    if (!local_grad.defined()) {
      EXPECT_TRUE(layers && is_layer_name(name, num_layers)) << name << " has no gradient";
      continue;
    }
    Tensor g = local_grad.clone();
    (is_slice(name) ? par.edp() : par.world()).all_reduce(g);
    summed[name] = g;
  }
  if (layers)
    layers->gather_gradients([&](const std::string& name, const Tensor& g) {
      EXPECT_FALSE(is_slice(name)) << name;
      EXPECT_TRUE(summed.emplace(name, g.clone()).second) << name << " twice";
    });
  ASSERT_EQ(summed.size(), ref_grads.named.size());
  double largest = 0, largest_slice = 0;
  int64_t regrouped = 0;
  for (const auto& [name, g] : summed) {
    const auto part = [&](const Tensor& want) {
      return is_slice(name) ? want.narrow(0, experts->first_expert(), experts->local_experts())
                            : want;
    };
    const double diff = rel_diff(g, part(*ref_grads.find(name)));
    if (fsdp && diff > 1e-6) {
      EXPECT_LE(rel_diff(g, part(*exact.find(name))), dist_test::regrouped_f32_bar(ref_error))
          << name;
      ++regrouped;
    } else {
      EXPECT_LE(diff, 1e-6) << name;
    }
    largest = std::max(largest, diff);
    if (is_slice(name)) largest_slice = std::max(largest_slice, diff);
  }
  largest = par.world().all_reduce_max(largest);
  largest_slice = par.world().all_reduce_max(largest_slice);
  regrouped = par.world().all_reduce_max(regrouped);
  if (par.is_root())
    std::printf(
        "ep_size %lld%s: largest relative gradient difference %.3g (expert slices %.3g)%s\n",
        static_cast<long long>(ep_size), fsdp ? ", fsdp" : "", largest, largest_slice,
        fsdp ? fmt::format("; {} past 1e-6, held to 3x the single-process f32 error {:.3g} "
                           "against f64",
                           regrouped, ref_error)
                   .c_str()
             : "");
  if (layers) {
    // Bytes per rank: the decoder layers' tensors but the routed experts in slices over dp (1/dp
    // up to the layout's padding, fewer than dp elements per layer), the routed experts 1/E.
    int64_t whole_layer_bytes = 0, whole_routed_bytes = 0;
    for (const auto& [name, t] : m.weights().named) {
      if (model::is_fused_expert_tensor(name))
        whole_routed_bytes += int64_t(t.nbytes());
      else if (is_layer_name(name, num_layers))
        whole_layer_bytes += int64_t(t.nbytes());
    }
    const int64_t dp = par.sizes().dp;
    const int64_t padding = num_layers * dp * int64_t(dtype_size(m.dtype()));
    EXPECT_EQ(layers->full_bytes(), whole_layer_bytes);
    EXPECT_GE(layers->resident_bytes(), whole_layer_bytes / dp);
    EXPECT_LE(layers->resident_bytes(), whole_layer_bytes / dp + padding);
    // Gradient slices only for the trained tensors (the indexer and the router biases sit in
    // flats without gradients): 1/dp of those, up to the same padding.
    EXPECT_LT(layers->full_gradient_bytes(), layers->full_bytes());
    EXPECT_GE(layers->gradient_bytes(), layers->full_gradient_bytes() / dp);
    EXPECT_LE(layers->gradient_bytes(), layers->full_gradient_bytes() / dp + padding);
    EXPECT_EQ(routed_bytes * ep_size, whole_routed_bytes);
    if (par.is_root())
      std::printf(
          "fsdp, ep_size %lld, dp %lld: decoder-layer weights but the routed experts %lld of "
          "%lld bytes per rank (gradients %lld), routed experts %lld of %lld\n",
          static_cast<long long>(ep_size), static_cast<long long>(dp),
          static_cast<long long>(layers->resident_bytes()),
          static_cast<long long>(whole_layer_bytes),
          static_cast<long long>(layers->gradient_bytes()), static_cast<long long>(routed_bytes),
          static_cast<long long>(whole_routed_bytes));
  }
  // The whole summed gradient of every tensor, the slices gathered over the ep group.
  std::map<std::string, Tensor> whole;
  for (const auto& [name, g] : summed) {
    if (!is_slice(name)) {
      whole[name] = g;
      continue;
    }
    Shape shape = g.shape();
    shape[0] = experts->experts();
    Tensor full = Tensor::empty(shape, g.dtype());
    par.ep().all_gather(g, full);
    whole[name] = full;
  }

  // The sharded optimizer from the local gradients against AdamW on their sum: the same update.
  // (Against AdamW on the single-process gradients, elements whose gradient is near 0 may move
  // by up to lr: Adam's first step is about lr·sign(g), and fp32 reduction order can flip it.)
  // With expert slices: the replicated tensors' optimizer over dp and the slices' over edp, one
  // global norm (each element counted once), each tensor's state gathered whole on rank 0.
  model::ParamStore ref_store = load_store(dir / "tiny");
  train::AdamW ref_opt(trainable(ref_store));
  std::vector<train::NamedParam> replicated = trainable(my_store);
  std::erase_if(replicated, [&](const train::NamedParam& p) {
    return is_slice(p.name) || (layers && is_layer_name(p.name, num_layers));
  });
  dist::ShardedAdamW opt(replicated, {}, par.dp());
  std::optional<ExpertAdamW> expert_opt;
  if (local) expert_opt.emplace(*local, train::AdamWConfig{}, par.edp());
  // The layer slices' pieces start from the stored values (a copy: the store keeps its own).
  std::optional<ShardedLayerAdamW> layer_opt;
  if (layers)
    layer_opt.emplace(
        *layers,
        [&](const std::string& name, int64_t begin, int64_t count) {
          return my_store.get(name).reshape({-1}).narrow(0, begin, count).clone();
        },
        train::AdamWConfig{});
  const double ref_norm = std::sqrt(ref_opt.grad_sq_norm(grad_list(ref_grads, ref_opt.params())));
  const double other_sq_norm =
      (expert_opt ? expert_opt->reduce_gradients(grad_list(grads, expert_opt->params())) : 0.0) +
      (layer_opt ? layer_opt->grad_sq_norm() : 0.0);
  const double norm = opt.reduce_gradients(grad_list(grads, opt.params()), other_sq_norm);
  EXPECT_NEAR(norm, ref_norm, 1e-6 * ref_norm);
  std::vector<Tensor> whole_grads;
  for (const train::NamedParam& p : ref_opt.params())
    whole_grads.push_back(p.trainable ? whole.at(p.name) : Tensor());
  ref_opt.step(whole_grads, 1e-3, norm);
  opt.step(1e-3, norm);
  if (expert_opt) expert_opt->step(1e-3, norm);
  if (layer_opt) layer_opt->step(1e-3, norm);
  for (size_t i = 0; i < ref_opt.params().size(); ++i) {
    if (!ref_opt.params()[i].trainable) continue;
    const std::string& name = ref_opt.params()[i].name;
    const std::array<Tensor, 3> state = is_slice(name) ? expert_opt->gather_state(name)
                                        : layer_opt && layers->holds(name)
                                            ? layer_opt->gather_state(name, 0)
                                            : opt.gather_state(name, 0);
    if (!par.is_root()) continue;
    // No ASSERT here: the other ranks go on with the next gather.
    const int64_t numel = ref_opt.params()[i].value.numel();
    if (!std::all_of(state.begin(), state.end(),
                     [&](const Tensor& t) { return t.defined() && t.numel() == numel; })) {
      ADD_FAILURE() << name << ": the gathered state is not the whole tensor's";
      continue;
    }
    EXPECT_LE(rel_diff(state[0], ref_opt.master(i)), 1e-6) << name;
    EXPECT_LE(rel_diff(state[1], ref_opt.exp_avg(i)), 1e-6) << name;
    EXPECT_LE(rel_diff(state[2], ref_opt.exp_avg_sq(i)), 1e-5) << name;
  }
  EXPECT_EQ(opt.step_count(), 1);
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

// Fully sharded decoder layers with expert parallelism (ep = 2; on 4 ranks two ep groups of 2,
// dp 4): the layers' tensors but the routed experts in slices over dp, the expert slices per ep
// rank as without fsdp.
TEST(DistExpertParallel, WithFsdpOneStepEqualsTheSingleProcessStep) {
  ParallelOptions options;
  options.ep_size = 2;
  options.timeout_s = 300;
  const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
  ASSERT_EQ(par->sizes().ep, 2);
  check_one_step(*par, 2, true);
}

// Bytes of AdamW state, measured as ShardedAdamW::state_bytes measures its shard: every storage
// of the parameters, masters and moments once.
int64_t adamw_state_bytes(const train::AdamW& opt) {
  int64_t bytes = 0;
  std::set<const Storage*> seen;
  const auto count = [&](const Tensor& t) {
    if (t.defined() && seen.insert(t.storage().get()).second)
      bytes += int64_t(t.storage()->bytes());
  };
  for (size_t i = 0; i < opt.params().size(); ++i) {
    count(opt.params()[i].value);
    count(opt.master(i));
    count(opt.exp_avg(i));
    count(opt.exp_avg_sq(i));
  }
  return bytes;
}

int64_t routed_expert_bytes(const std::vector<std::pair<std::string, Tensor>>& named) {
  int64_t bytes = 0;
  for (const auto& [name, t] : named)
    if (model::is_fused_expert_tensor(name)) bytes += int64_t(t.nbytes());
  return bytes;
}

// With ep_size = E each rank loads 1/E of the routed experts' weights into its parameter store,
// exactly (the allocated bytes of the store as loaded, before anything else touches it), and they
// are the whole load's values of its experts; it holds 1/E of them in the model and of their
// gradient buffers, and its share of their optimizer state: sharded over the edp
// group, 1/dp of the whole up to the padding of the flat layout, the ranks' shares adding up to
// the unsharded AdamW's state. A non-finite expert weight is named per expert on every rank.
TEST(DistExpertParallel, EachRankHoldsItsShareOfTheExperts) {
  const int world = testing::world_context()->sizes().world;
  for (int64_t ep_size : std::set<int64_t>{2, world}) {
    SCOPED_TRACE("ep_size " + std::to_string(ep_size));
    ParallelOptions options;
    options.ep_size = ep_size;
    options.timeout_s = 300;
    const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
    test::TempDir dir("dist-grad-bytes-" + std::to_string(par->rank()));
    model::InitOptions init;
    init.seed = 5;
    model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", init);
    model::ParamStore whole_store = load_store(dir / "tiny");
    const model::text::TextModel whole(whole_store);
    const ExpertParallel experts(par->ep(), whole.text().n_routed_experts, "test");
    model::ParamStore store = load_store(dir / "tiny", local_range(experts));

    // The store as loaded: its routed-expert tensors are this rank's experts, and the memory
    // allocated for them is their share of the whole.
    int64_t whole_store_bytes = 0, loaded_bytes = 0;
    std::vector<train::NamedParam> whole_experts;
    for (const train::NamedParam& p : trainable(whole_store))
      if (model::is_fused_expert_tensor(p.name)) {
        whole_store_bytes += int64_t(p.value.storage()->bytes());
        whole_experts.push_back(p);
        const Tensor& loaded = store.get(p.name);
        loaded_bytes += int64_t(loaded.storage()->bytes());
        EXPECT_EQ(loaded.to_doubles(),
                  p.value.narrow(0, experts.first_expert(), experts.local_experts()).to_doubles())
            << p.name;
      }
    ASSERT_GT(whole_store_bytes, 0);
    EXPECT_EQ(loaded_bytes * ep_size, whole_store_bytes);
    const LocalExperts local(store, experts);
    const model::text::TextModel mine(store);
    EXPECT_EQ(local.full_bytes(), whole_store_bytes);
    EXPECT_EQ(local.local_bytes() * ep_size, whole_store_bytes);
    const int64_t whole_weights = routed_expert_bytes(whole.weights().named);
    const int64_t my_weights = routed_expert_bytes(mine.weights().named);
    EXPECT_EQ(my_weights * ep_size, whole_weights);
    const int64_t whole_grads =
        routed_expert_bytes(model::text::TextGrads::zeros_like(whole.weights()).named);
    const int64_t my_grads =
        routed_expert_bytes(model::text::TextGrads::zeros_like(mine.weights()).named);
    EXPECT_EQ(my_grads * ep_size, whole_grads);

    const ExpertAdamW opt(local, {}, par->edp());
    const int64_t whole_state = adamw_state_bytes(train::AdamW(whole_experts));
    const int64_t my_state = opt.state_bytes();
    EXPECT_EQ(par->world().all_reduce_sum(my_state), whole_state);
    // 16 bytes per element at most (a bf16 value, an f32 master and two moments), and a shard is
    // at most dp − 1 elements of padding short of 1/dp.
    const int64_t dp = par->sizes().dp;
    EXPECT_NEAR(double(my_state), double(whole_state) / double(dp), 16.0 * double(dp));
    EXPECT_LE(my_state * ep_size, whole_state + 16 * dp * ep_size);
    // A non-finite element in the last rank's last expert (its up projection) is named on every
    // rank under the released per-expert name.
    const std::string layer = model::text::layer_prefix(1);
    Tensor& gate_up = store.get(layer + "mlp.experts.gate_up_proj");
    const int64_t n = experts.experts();
    if (par->ep().rank() == par->ep().size() - 1 && par->edp().rank() == 0)
      gate_up.select(0, experts.local_experts() - 1)
          .select(0, gate_up.size(1) - 1)
          .copy_(Tensor::full({gate_up.size(2)}, std::nan(""), gate_up.dtype()));
    const std::vector<std::string> bad =
        local.nonfinite([&](const std::string& name) { return &store.get(name); }, par->world(), 4);
    EXPECT_EQ(
        bad,
        (std::vector<std::string>{fmt::format("{}mlp.experts.{}.up_proj.weight", layer, n - 1)}));
    if (par->is_root())
      std::printf(
          "ep_size %lld, dp %lld: routed experts per rank: loaded %lld of %lld bytes, store %lld, "
          "model %lld of %lld, gradients %lld of %lld, optimizer state %lld of %lld\n",
          static_cast<long long>(ep_size), static_cast<long long>(dp),
          static_cast<long long>(loaded_bytes), static_cast<long long>(whole_store_bytes),
          static_cast<long long>(local.local_bytes()), static_cast<long long>(my_weights),
          static_cast<long long>(whole_weights), static_cast<long long>(my_grads),
          static_cast<long long>(whole_grads), static_cast<long long>(my_state),
          static_cast<long long>(whole_state));
  }
}

// A single process's checkpoint (the whole store and the unsharded AdamW with a non-trivial
// state) resumed with expert slices: each rank reads its pieces of the saved optimizer state by
// ranges, allocating no tensor, and they are the saved values; saved again, the expert tensors and
// their state gathered one at a time, rank 0's extra memory stays a small multiple of the largest
// tensor and the files are byte for byte the single process's.
TEST(DistExpertParallel, ResumeReadsRangesAndSaveGathersOneTensorAtATime) {
  const int world = testing::world_context()->sizes().world;
  for (int64_t ep_size : std::set<int64_t>{2, world}) {
    SCOPED_TRACE("ep_size " + std::to_string(ep_size));
    ParallelOptions options;
    options.ep_size = ep_size;
    options.timeout_s = 300;
    const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
    test::TempDir dir("dist-grad-stream-" + std::to_string(par->rank()));
    model::InitOptions init;
    init.seed = 9;
    model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", init);
    int64_t largest_tensor = 0, whole_state_bytes = 0;
    std::vector<std::pair<std::string, Shape>> trained_shapes;
    std::unique_ptr<train::AdamW> reference;
    model::ParamStore whole_store = load_store(dir / "tiny");
    {
      reference = std::make_unique<train::AdamW>(trainable(whole_store));
      std::mt19937_64 rng(23);
      std::normal_distribution<float> normal(0.0f, 0.02f);
      const auto random = [&](const Shape& shape, bool positive) {
        std::vector<float> v(size_t(shape_numel(shape)));
        for (float& x : v) x = positive ? std::abs(normal(rng)) : normal(rng);
        return Tensor::from_vector(v, shape);
      };
      for (size_t i = 0; i < reference->params().size(); ++i) {
        const train::NamedParam& p = reference->params()[i];
        largest_tensor = std::max(largest_tensor, p.value.numel());
        if (!p.trainable) continue;
        reference->set_state(i, random(p.value.shape(), false), random(p.value.shape(), false),
                             random(p.value.shape(), true));
        trained_shapes.emplace_back(p.name, p.value.shape());
      }
      reference->set_step_count(3);
      whole_state_bytes = reference->state_bytes();
      whole_store.save(dir / "ref" / "model");
      reference->save(dir / "ref" / "optimizer");
    }
    const model::text::TextModel whole(whole_store);
    const ExpertParallel experts(par->ep(), whole.text().n_routed_experts, "test");
    model::ParamStore store = load_store(dir / "ref" / "model", local_range(experts));
    const LocalExperts local(store, experts);
    ExpertAdamW expert_optimizer(local, {}, par->edp());
    std::vector<train::NamedParam> replicated = trainable(store);
    std::erase_if(replicated, [&](const train::NamedParam& p) { return local.holds(p.name); });
    ShardedAdamW replicated_optimizer(replicated, {}, par->dp());

    host_allocator().reset_peak();
    const int64_t base = int64_t(host_allocator().stats().allocated);
    {
      const train::SavedAdamWState saved = train::SavedAdamWState::open(dir / "ref" / "optimizer");
      saved.check(trained_shapes);
      replicated_optimizer.load(saved);
      expert_optimizer.load(saved);
    }
    const int64_t resume_peak = int64_t(host_allocator().stats().peak_allocated) - base;
    EXPECT_EQ(int64_t(host_allocator().stats().allocated), base);
    EXPECT_LE(resume_peak, 4096) << "a ranged read allocates no tensor";

    const model::ParamStore::WholeValue whole_value = [&](const model::InternalParam& p) -> Tensor {
      if (!local.holds(p.name)) return p.value;
      return par->edp().rank() == 0 ? local.gather_one(p.name) : Tensor();
    };
    const train::WholeOptimizerState whole_state =
        [&](const std::string& name) -> std::array<Tensor, 3> {
      return local.holds(name) ? expert_optimizer.gather_state(name)
                               : replicated_optimizer.gather_state(name, 0);
    };
    host_allocator().reset_peak();
    const int64_t save_base = int64_t(host_allocator().stats().allocated);
    if (par->is_root()) {
      store.save(dir / "streamed" / "model", whole_value);
      train::save_optimizer_state(dir / "streamed" / "optimizer", trained_shapes,
                                  replicated_optimizer.step_count(), whole_state);
    } else {
      store.visit_for_save(whole_value);
      train::visit_optimizer_state(trained_shapes, whole_state);
    }
    const int64_t save_peak = int64_t(host_allocator().stats().peak_allocated) - save_base;
    // One tensor's three state vectors gathered whole (and, for an expert tensor, the slices they
    // came from): a small multiple of the largest tensor, whatever the model's size.
    const int64_t save_bound = 4 * largest_tensor * 4;
    EXPECT_LT(save_bound, whole_state_bytes) << "the bound must not allow the whole state";
    if (par->is_root()) {
      EXPECT_LE(save_peak, save_bound);
      for (const char* part : {"model", "optimizer"})
        test::expect_same_files(dir / "streamed" / part, dir / "ref" / part);
      std::printf(
          "ep_size %lld: resume peak %lld bytes (ranged), save peak on rank 0 %lld (largest "
          "tensor %lld f32 bytes, whole optimizer state %lld)\n",
          static_cast<long long>(ep_size), static_cast<long long>(resume_peak),
          static_cast<long long>(save_peak), static_cast<long long>(largest_tensor * 4),
          static_cast<long long>(whole_state_bytes));
    }
  }
}

}  // namespace
}  // namespace glmtune::dist

int main(int argc, char** argv) { return glmtune::dist::testing::run_all_tests(argc, argv); }

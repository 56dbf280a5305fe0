// Vision-language sequence parallelism under mpirun against the single-process step, on the
// examples/tiny-vl conversations (real images and a video) with the tiny model: each pack and its
// media are split over an sp group of 2 (the tower by whole merge blocks, the text by rows), the
// tower's attention reads the keys and values of every shard, the merged tokens are spliced at
// their global positions, and the summed losses and every gradient (text and vision) equal what
// one process computes from whole packs. On 4 ranks the same with dp = 2 × sp = 2. Expert
// parallelism with the same data: ep = 2 on 2 ranks, dp × ep = 2 × 2 and sp × ep = 2 × 2 on 4, each
// rank holding its slice of the routed experts while the tower and projector stay replicated. Fully
// sharded decoder layers (fsdp) with the same data: over dp = 2 on 2 ranks and 4 on 4, and with sp
// (dp 2 × sp 2 on 4 ranks) and ep (dp 2 × ep 2 on 4), the tower and projector again replicated.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../unit/support/temp_dir.h"
#include "dist_support.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/dist/expert_shards.h"
#include "glmtune/dist/fsdp.h"
#include "glmtune/dist/sequence_parallel.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/init.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/vl_batch.h"
#include "mpi_main.h"

namespace glmtune::dist {
namespace {

namespace fs = std::filesystem;
using dist_test::count_targets;
using dist_test::rel_diff;
using model::text::PackInput;

const fs::path kExample = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny-vl";
const fs::path kProcessor = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny" / "tokenizer";
constexpr int64_t kPacksPerGroup = 2;

struct VlPack {
  PackInput input;
  model::PackMedia media;
};

// The data, the tiny model's store and the step's packs (the same on every rank).
struct VlSetup {
  std::unique_ptr<test::TempDir> dir;
  std::unique_ptr<data::media::VlProcessor> processor;
  std::unique_ptr<train::VlDataset> dataset;
  std::unique_ptr<model::ParamStore> store;
  std::vector<VlPack> packs;

  VlSetup(int rank, int64_t packs_total) {
    dir = std::make_unique<test::TempDir>("dist-vl-sp-" + std::to_string(rank));
    processor =
        std::make_unique<data::media::VlProcessor>(data::media::VlProcessor::from_dir(kProcessor));
    train::VlDataConfig dc;
    dc.files = {(kExample / "chat.jsonl").string()};
    dc.media_root = kExample;
    dc.max_length = 1024;
    dataset = std::make_unique<train::VlDataset>(train::VlDataset::scan(dc, *processor));
    const model::ModelConfig config = model::ModelConfig::preset("tiny");
    model::InitOptions init;
    init.seed = 9;
    model::write_random_checkpoint(config, dir->path() / "ck", init);
    store = std::make_unique<model::ParamStore>(
        model::ParamStore::load(io::CheckpointReader::open(dir->path() / "ck"), config));
    train::make_params_writable(*store);
    data::PackingConfig pc;
    pc.pack_max_length = 512;
    pc.seed = 5;
    pc.pad_id = processor->tokenizer().require_id("<|endoftext|>");
    data::PackSampler sampler(*dataset, pc);
    for (int64_t i = 0; i < packs_total; ++i) {
      const data::Pack pack = sampler.next();
      VlPack p;
      p.input.input_ids = Tensor::from_vector(pack.input_ids, {int64_t(pack.input_ids.size())});
      p.input.cu_seqlens = Tensor::from_vector(pack.cu_seqlens, {int64_t(pack.cu_seqlens.size())});
      p.input.labels = Tensor::from_vector(pack.labels, {int64_t(pack.labels.size())});
      p.input.padding_tokens = pack.num_padding;
      p.media = train::pack_media(*dataset, pack);
      packs.push_back(std::move(p));
    }
  }
};

// The step's options: recomputed layers, MTP, the balancing loss and the step's denominators.
model::text::TrainOptions step_options(const model::VisionLanguageModel& m,
                                       const std::vector<VlPack>& packs) {
  model::text::TrainOptions topt;
  const model::TextConfig& tc = m.text().text();
  topt.activations = model::text::activation_policy(tc.num_hidden_layers, 0.4);
  topt.recompute_mtp = true;
  topt.mtp = m.text().has_mtp();
  topt.mtp_depths = tc.num_nextn_predict_layers;
  topt.balancing_alpha = 0.001;
  topt.num_micro_packs = int64_t(packs.size());
  int64_t lm_targets = 0;
  std::vector<int64_t> mtp_targets(size_t(topt.mtp_depths), 0);
  for (const VlPack& p : packs) {
    lm_targets += count_targets(p.input.labels);
    for (int64_t k = 1; k <= topt.mtp_depths; ++k)
      mtp_targets[size_t(k - 1)] +=
          count_targets(model::shift_labels(p.input.labels, p.input.cu_seqlens, k));
  }
  topt.lm_denominator = double(lm_targets);
  for (int64_t n : mtp_targets) topt.mtp_denominators.push_back(double(n));
  return topt;
}

// Loss sums and gradients of some packs.
struct VlStep {
  double lm = 0, balancing = 0;
  std::vector<double> mtp;
  std::map<std::string, std::vector<int64_t>> loads;
  model::text::TextGrads text;
  model::vision::VisionGrads vision;
};

// Buffers of a step of `m`, made before any ShardedLayers of `m` (which takes the layers' ones).
void start_step(const model::VisionLanguageModel& m, const model::text::TrainOptions& topt,
                VlStep& s) {
  s.mtp.assign(size_t(topt.mtp_depths), 0.0);
  s.text = model::text::TextGrads::zeros_like(m.text().weights());
  s.vision = model::vision::VisionGrads::zeros_like(m.vision());
}

void add_packs(const model::VisionLanguageModel& m, const std::vector<VlPack>& packs,
               const model::text::TrainOptions& topt, VlStep& s) {
  for (const VlPack& p : packs) {
    const auto r = model::compose_forward_backward(m, p.input, p.media, topt, {}, s.text, s.vision);
    s.lm += r.backward.lm_loss_sum;
    s.balancing += r.backward.balancing_loss;
    for (size_t k = 0; k < s.mtp.size(); ++k) s.mtp[k] += r.backward.mtp_loss_sum[k];
    for (const auto& l : r.loads) {
      std::vector<int64_t>& counts = s.loads[l.bias_name];
      counts.resize(size_t(l.counts.numel()), 0);
      for (int64_t e = 0; e < l.counts.numel(); ++e)
        counts[size_t(e)] += l.counts.data<int64_t>()[e];
    }
  }
}

VlStep run_packs(const model::VisionLanguageModel& m, const std::vector<VlPack>& packs,
                 const model::text::TrainOptions& topt) {
  VlStep s;
  start_step(m, topt, s);
  add_packs(m, packs, topt, s);
  return s;
}

// Every gradient by released name, summed over `group` when given.
std::vector<std::pair<std::string, Tensor>> all_grads(const model::VisionLanguageModel& m,
                                                      const VlStep& s, Communicator* group) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, g] : s.text.named)
    if (g.defined()) out.emplace_back(name, g.clone());
  for (auto& named : s.vision.released(m.vision_config())) out.push_back(std::move(named));
  if (group)
    for (auto& [name, g] : out) group->all_reduce(g);
  return out;
}

// One step of 2 packs per data-parallel index (an sp group, or one rank without sp) against the
// single-process step. In f64 every gradient to `tolerance`; in f32 (the conventions of
// test_dist_sp) each gradient's error against the f64 gradient within 3× the single-process f32
// run's largest error, and within `tolerance` of the single-process f32 gradient. With
// `ep_size` > 1 each rank's model is built from a store holding its slice of the routed experts
// only: a slice's gradient, summed over the ranks holding that slice, is compared with the same
// experts of the single-process gradient. With `fsdp` the decoder layers (the routed-expert slices
// apart) are sharded over dp: their gradients are reduce-scattered in the backward and gathered
// whole for the comparison.
void check_one_step(DType dtype, double tolerance, int64_t sp_size, int64_t ep_size = 1,
                    bool fsdp = false) {
  ParallelOptions options;
  options.sp_size = sp_size;
  options.ep_size = ep_size;
  options.timeout_s = 300;
  const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
  ASSERT_EQ(par->sizes().sp, sp_size) << "run under mpirun with 2 or 4 ranks";
  ASSERT_EQ(par->sizes().ep, ep_size);
  const int64_t packs_total = kPacksPerGroup * par->sizes().dp;
  const VlSetup setup(par->rank(), packs_total);
  for (const VlPack& p : setup.packs) ASSERT_FALSE(p.media.empty()) << "every pack has media";
  const model::VisionLanguageModel m(*setup.store, model::text::TextModelOptions{dtype});
  model::text::TrainOptions topt = step_options(m, setup.packs);
  ASSERT_GT(topt.mtp_depths, 0);

  const VlStep ref = run_packs(m, setup.packs, topt);
  const std::vector<std::pair<std::string, Tensor>> want = all_grads(m, ref, nullptr);

  const int64_t d = par->dp().rank();
  const std::vector<VlPack> mine(setup.packs.begin() + d * kPacksPerGroup,
                                 setup.packs.begin() + (d + 1) * kPacksPerGroup);
  model::text::TrainOptions split = topt;
  std::optional<UlyssesParallel> ulysses;
  if (sp_size > 1) {
    ulysses.emplace(par->sp(), m.text().text().linear_num_heads,
                    m.text().text().num_attention_heads, "test");
    split.sequence_parallel = &*ulysses;
  }
  std::optional<ExpertParallel> experts;
  std::optional<model::ParamStore> slice_store;
  std::optional<LocalExperts> local;
  if (ep_size > 1) {
    experts.emplace(par->ep(), m.text().text().n_routed_experts, "test");
    slice_store.emplace(
        model::ParamStore::load(io::CheckpointReader::open(setup.dir->path() / "ck"),
                                setup.store->config(), local_range(*experts)));
    local.emplace(*slice_store, *experts);
    split.expert_dispatch = &*experts;
  }
  const auto is_slice = [&](const std::string& name) { return local && local->holds(name); };
  std::optional<model::VisionLanguageModel> own;
  if (slice_store || fsdp)
    own.emplace(slice_store ? *slice_store : *setup.store, model::text::TextModelOptions{dtype});
  const model::VisionLanguageModel& my_model = own ? *own : m;
  VlStep got;
  start_step(my_model, split, got);
  std::optional<ShardedLayers> layers;
  if (fsdp) {
    layers.emplace(
        own->text().weights(), got.text, par->dp(),
        LayerSource{[](const std::string&) -> std::optional<Shape> { return std::nullopt; },
                    nullptr, is_slice});
    split.layer_params = &*layers;
  }
  add_packs(my_model, mine, split, got);
  // The sharded layers' gradients, summed over the sp group and dp like the replicated ones below.
  std::map<std::string, Tensor> layer_grads;
  if (layers) {
    if (sp_size > 1) layers->all_reduce_gradients(par->sp());
    layers->gather_gradients([&](const std::string& name, const Tensor& g) {
      EXPECT_TRUE(layer_grads.emplace(name, g.clone()).second) << name;
    });
    EXPECT_GT(layer_grads.size(), 10u);
    for (const auto& [name, g] : got.text.named)
      EXPECT_FALSE(g.defined() && layer_grads.count(name)) << name << " still whole";
  }
  if (local) {
    int64_t slices = 0;
    for (const auto& [name, g] : got.text.named) {
      if (!model::is_fused_expert_tensor(name)) continue;
      ++slices;
      EXPECT_TRUE(is_slice(name)) << name;
      EXPECT_EQ(g.size(0), experts->local_experts()) << name;
    }
    EXPECT_GT(slices, 0);
  }

  std::vector<double> sums = {got.lm, got.balancing};
  sums.insert(sums.end(), got.mtp.begin(), got.mtp.end());
  par->world().all_reduce_sum(sums);
  EXPECT_NE(got.lm, sums[0]) << "the ranks split the step's loss";
  EXPECT_NEAR(sums[0] / topt.lm_denominator, ref.lm / topt.lm_denominator, 1e-6);
  EXPECT_GT(ref.balancing, 0);
  EXPECT_NEAR(sums[1], ref.balancing, 1e-6 * std::max(1.0, ref.balancing));
  for (size_t k = 0; k < got.mtp.size(); ++k)
    EXPECT_NEAR(sums[2 + k] / topt.mtp_denominators[k], ref.mtp[k] / topt.mtp_denominators[k],
                1e-6);
  ASSERT_EQ(got.loads.size(), ref.loads.size());
  for (const auto& [name, counts] : got.loads) {
    std::vector<int64_t> total = counts;
    par->world().all_reduce_sum(total);
    EXPECT_EQ(total, ref.loads.at(name)) << name;
  }

  std::vector<std::pair<std::string, Tensor>> exact;
  double ref_error = 0;
  if (dtype == DType::f32) {
    const model::VisionLanguageModel wide(*setup.store, model::text::TextModelOptions{DType::f64});
    exact = all_grads(wide, run_packs(wide, setup.packs, topt), nullptr);
    ASSERT_EQ(exact.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
      ref_error = std::max(ref_error, rel_diff(want[i].second, exact[i].second));
    EXPECT_LT(ref_error, 1e-4);
  }
  // This rank's vision gradient is a part of the sum: the tower really ran on this rank's share
  // (a shard of the pack's patches with sp, its own packs without).
  const auto mine_vision = got.vision.released(my_model.vision_config());
  const auto patch_embed = [](const std::vector<std::pair<std::string, Tensor>>& grads) {
    for (const auto& [name, g] : grads)
      if (name == "model.visual.patch_embed.proj.weight") return g;
    return Tensor();
  };
  // Summed over the sp group (each rank holds its rows' part of every gradient), then over the
  // ranks holding the same tensor: every data index for a replicated one, the edp group for an
  // expert slice (the other ep indices hold other experts).
  std::vector<std::pair<std::string, Tensor>> summed = all_grads(my_model, got, &par->sp());
  for (auto& [name, g] : summed) (is_slice(name) ? par->edp() : par->dp()).all_reduce(g);
  if (layers) {
    std::map<std::string, Tensor> by_name(summed.begin(), summed.end());
    by_name.merge(layer_grads);
    EXPECT_TRUE(layer_grads.empty()) << "a sharded gradient also held whole";
    summed.clear();
    for (const auto& [name, g] : want)
      if (by_name.count(name)) summed.emplace_back(name, by_name.at(name));
  }
  ASSERT_EQ(summed.size(), want.size());
  EXPECT_GT(rel_diff(patch_embed(mine_vision), patch_embed(summed)), 1e-3);
  const auto part = [&](const std::string& name, const Tensor& whole) {
    return is_slice(name) ? whole.narrow(0, experts->first_expert(), experts->local_experts())
                          : whole;
  };
  int64_t vision_tensors = 0;
  double largest = 0, largest_slice = 0, largest_vision = 0;
  for (size_t i = 0; i < summed.size(); ++i) {
    const std::string& name = summed[i].first;
    ASSERT_EQ(name, want[i].first);
    vision_tensors += name.starts_with("model.visual.") ? 1 : 0;
    const double diff = rel_diff(summed[i].second, part(name, want[i].second));
    EXPECT_LE(diff, tolerance) << name;
    if (dtype == DType::f32)
      EXPECT_LE(rel_diff(summed[i].second, part(name, exact[i].second)),
                dist_test::regrouped_f32_bar(ref_error))
          << name;
    largest = std::max(largest, diff);
    if (is_slice(name)) largest_slice = std::max(largest_slice, diff);
    if (name.starts_with("model.visual.")) largest_vision = std::max(largest_vision, diff);
  }
  EXPECT_GT(vision_tensors, 10);
  largest = par->world().all_reduce_max(largest);
  largest_slice = par->world().all_reduce_max(largest_slice);
  largest_vision = par->world().all_reduce_max(largest_vision);
  if (par->is_root())
    std::printf(
        "%s, sp_size %lld, ep_size %lld, dp %lld%s: largest relative gradient difference %.3g "
        "(expert slices %.3g, vision %.3g)\n",
        dtype == DType::f64 ? "f64" : "f32", static_cast<long long>(sp_size),
        static_cast<long long>(ep_size), static_cast<long long>(par->sizes().dp),
        fsdp ? ", fsdp" : "", largest, largest_slice, largest_vision);
}

// In f64 the split step is the single-process step up to rounding: a patch, key, merged token or
// gradient that went to the wrong rank or row would show as an O(1) difference.
TEST(DistVisionSequenceParallel, OneStepEqualsTheSingleProcessStepInF64) {
  check_one_step(DType::f64, 1e-10, 2);
}

TEST(DistVisionSequenceParallel, OneStepEqualsTheSingleProcessStep) {
  check_one_step(DType::f32, 1e-4, 2);
}

// Expert parallelism with media: ep = 2 (on 4 ranks dp × ep = 2 × 2: two ep groups of 2). In f64 a
// token routed to the wrong rank, or an expert gradient added to the wrong slice, would show as an
// O(1) difference; the tower's gradients come from each rank's own packs, as in data parallelism.
TEST(DistVisionExpertParallel, OneStepEqualsTheSingleProcessStepInF64) {
  check_one_step(DType::f64, 1e-10, 1, 2);
}

// Without sp each pack runs whole on one rank, so the f32 bar is the text ep test's
// (test_dist_grad.cpp): only whole packs and the experts' rows are regrouped.
TEST(DistVisionExpertParallel, OneStepEqualsTheSingleProcessStep) {
  check_one_step(DType::f32, 1e-6, 1, 2);
}

// sp × ep = 2 × 2 (4 ranks): each pack and its media split over an sp group, the routed experts
// over the ep group of the two data indices.
TEST(DistVisionExpertParallel, WithSequenceParallelOneStepEqualsTheSingleProcessStepInF64) {
  if (testing::world_context()->sizes().world < 4) GTEST_SKIP() << "sp × ep needs 4 ranks";
  check_one_step(DType::f64, 1e-10, 2, 2);
}

TEST(DistVisionExpertParallel, WithSequenceParallelOneStepEqualsTheSingleProcessStep) {
  if (testing::world_context()->sizes().world < 4) GTEST_SKIP() << "sp × ep needs 4 ranks";
  check_one_step(DType::f32, 1e-4, 2, 2);
}

// Fully sharded decoder layers over dp (2 or 4 ranks) with media: in f64 a layer gradient
// reduce-scattered to the wrong slice, or a layer gathered from the wrong pieces, would show as an
// O(1) difference; the tower and projector stay replicated and are summed as in data parallelism.
TEST(DistVisionFsdp, OneStepEqualsTheSingleProcessStepInF64) {
  check_one_step(DType::f64, 1e-10, 1, 1, true);
}

// Whole packs per rank: the bar of the text fsdp test (test_dist_fsdp.cpp).
TEST(DistVisionFsdp, OneStepEqualsTheSingleProcessStep) {
  check_one_step(DType::f32, 1e-6, 1, 1, true);
}

// dp × sp = 2 × 2 with fsdp: the sp group's ranks hold the same slices, each with its rows' share.
TEST(DistVisionFsdp, WithSequenceParallelOneStepEqualsTheSingleProcessStepInF64) {
  if (testing::world_context()->sizes().world < 4) GTEST_SKIP() << "dp × sp needs 4 ranks";
  check_one_step(DType::f64, 1e-10, 2, 1, true);
}

TEST(DistVisionFsdp, WithSequenceParallelOneStepEqualsTheSingleProcessStep) {
  if (testing::world_context()->sizes().world < 4) GTEST_SKIP() << "dp × sp needs 4 ranks";
  check_one_step(DType::f32, 1e-4, 2, 1, true);
}

// dp × ep = 2 × 2 with fsdp: the routed-expert slices stay out of the sharded layout.
TEST(DistVisionFsdp, WithExpertParallelOneStepEqualsTheSingleProcessStepInF64) {
  if (testing::world_context()->sizes().world < 4) GTEST_SKIP() << "dp × ep needs 4 ranks";
  check_one_step(DType::f64, 1e-10, 1, 2, true);
}

// The tower's shards are whole merge blocks that tile the pack's patches in rank order, and the
// border of the packs used above falls inside an image (so the attention crosses the shards).
TEST(DistVisionSequenceParallel, ShardsAreWholeMergeBlocksAndSplitAnImage) {
  ParallelContext& par = *testing::world_context();
  const UlyssesParallel sp(par.world(), par.sizes().world, par.sizes().world, "test");
  const VlSetup setup(par.rank(), 2);
  const model::VisionConfig& vc = *setup.store->config().vision();
  const int64_t merge = vc.spatial_merge_size * vc.spatial_merge_size;
  bool border_inside_a_segment = false;
  for (const VlPack& p : setup.packs) {
    std::vector<model::vision::GridThw> grid = p.media.image_grid;
    grid.insert(grid.end(), p.media.video_grid.begin(), p.media.video_grid.end());
    const std::vector<int64_t> cu = model::vision::vision_cu_seqlens(grid);
    const model::vision::VisionShard shard =
        model::vision::vision_shard(sp, cu.back(), vc.spatial_merge_size, "test");
    int64_t begin = 0;
    for (int q = 0; q < par.sizes().world; ++q) {
      EXPECT_EQ(shard.patch_counts[size_t(q)] % merge, 0);
      EXPECT_GT(shard.patch_counts[size_t(q)], 0);
      if (q == par.rank()) EXPECT_EQ(shard.patch_begin, begin);
      if (q > 0) border_inside_a_segment |= !std::binary_search(cu.begin(), cu.end(), begin);
      begin += shard.patch_counts[size_t(q)];
    }
    EXPECT_EQ(begin, cu.back());
  }
  EXPECT_TRUE(border_inside_a_segment);
  EXPECT_THROW(model::vision::vision_shard(sp, merge * (par.sizes().world - 1),
                                           vc.spatial_merge_size, "train.sp_size"),
               Error);
}

}  // namespace
}  // namespace glmtune::dist

int main(int argc, char** argv) { return glmtune::dist::testing::run_all_tests(argc, argv); }

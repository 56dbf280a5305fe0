// Vision tower + projector backward against transformers 5.17.0 autograd in float32 (fixture from
// tools/golden/vision_backward.py): one image, a pack of three images and a video of three
// tubelets, each with a random upstream gradient of the merger output. Also the frozen-part
// options: a frozen part gets no gradient and leaves the other part's gradients unchanged.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "glmtune/io/safetensors.h"
#include "glmtune/model/vision/tower.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::model;
using namespace glmtune::model::vision;

namespace {

const std::string kFixture =
    std::string(GLMTUNE_SOURCE_DIR) + "/tests/golden/vision/tower_backward.safetensors";
constexpr test::RelErr rel_err{.zero_reference_fails = true};

VisionConfig fixture_config(const io::SafetensorsFile& file) {
  const auto j = nlohmann::json::parse(file.metadata().at("vision_config"));
  VisionConfig c;
  c.depth = j.at("depth");
  c.hidden_size = j.at("hidden_size");
  c.num_heads = j.at("num_heads");
  c.intermediate_size = j.at("intermediate_size");
  c.out_hidden_size = j.at("out_hidden_size");
  c.projection_intermediate_size = j.at("projection_intermediate_size");
  c.patch_size = j.at("patch_size");
  c.temporal_patch_size = j.at("temporal_patch_size");
  c.spatial_merge_size = j.at("spatial_merge_size");
  c.in_channels = j.at("in_channels");
  c.image_size = j.at("image_size");
  c.swiglu_limit = j.at("swiglu_limit");
  return c;
}

VisionParams fixture_params(const io::SafetensorsFile& file, const VisionConfig& config,
                            DType dtype) {
  return VisionParams::load(
      config,
      [&](const std::string& name) {
        return file.contains("param." + name) ? file.tensor("param." + name) : Tensor();
      },
      dtype);
}

struct CaseRun {
  VisionOutput out;
  VisionContext context;
  VisionGrads grads;
  Tensor d_pixels;
};

CaseRun run_case(const io::SafetensorsFile& file, const VisionConfig& config,
                 const VisionParams& params, const std::string& c,
                 const VisionBackwardOptions& options, bool recompute_blocks = false) {
  CaseRun r;
  r.context.recompute_blocks = recompute_blocks;
  r.out = vision_forward(config, params, file.tensor(c + ".pixel_values"),
                         grid_from_tensor(file.tensor(c + ".grid_thw")), &r.context);
  r.grads = VisionGrads::zeros_like(params);
  r.d_pixels =
      vision_backward(config, params, r.context, file.tensor(c + ".d_pooler"), r.grads, options);
  return r;
}

class VisionBackwardGolden : public testing::TestWithParam<std::string> {};

TEST_P(VisionBackwardGolden, MatchesReferenceAutograd) {
  const std::string c = GetParam();
  const auto file = io::SafetensorsFile::open(kFixture);
  const VisionConfig config = fixture_config(file);
  for (DType dtype : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const VisionParams params = fixture_params(file, config, dtype);
    VisionBackwardOptions options;
    options.pixel_grad = true;
    const CaseRun r = run_case(file, config, params, c, options);
    EXPECT_LE(rel_err(r.out.pooler_output, file.tensor(c + ".pooler_output")), 1e-5);
    EXPECT_LE(rel_err(r.d_pixels, file.tensor(c + ".d_pixels")), 1e-4) << "pixel rows";
    std::set<std::string> seen;
    for (const auto& [name, g] : r.grads.released(config)) {
      const std::string key = c + ".grad." + name;
      ASSERT_TRUE(file.contains(key)) << name << " has no reference gradient";
      EXPECT_LE(rel_err(g, file.tensor(key)), 1e-4) << name;
      seen.insert(key);
    }
    for (const std::string& name : file.names())
      if (name.starts_with(c + ".grad.")) EXPECT_TRUE(seen.count(name)) << name << " not computed";
    EXPECT_EQ(seen.size(), size_t(2 + 14 * config.depth + 1 + 8));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, VisionBackwardGolden, testing::Values("single", "multi", "video"));

TEST(VisionBackward, FrozenPartsGetNoGradient) {
  const auto file = io::SafetensorsFile::open(kFixture);
  const VisionConfig config = fixture_config(file);
  const VisionParams params = fixture_params(file, config, DType::f64);
  const CaseRun all = run_case(file, config, params, "multi", {});
  const auto all_grads = all.grads.released(config);
  EXPECT_FALSE(all.d_pixels.defined());  // not asked for
  auto grads_of = [&](const VisionGrads& g, VisionGrads::Part part) {
    return g.released(config, part);
  };

  for (const bool tower : {false, true})
    for (const bool projector : {false, true}) {
      SCOPED_TRACE(testing::Message() << "train tower " << tower << ", projector " << projector);
      VisionBackwardOptions options;
      options.train_tower = tower;
      options.train_projector = projector;
      const CaseRun r = run_case(file, config, params, "multi", options);
      for (const auto part : {VisionGrads::Part::tower, VisionGrads::Part::projector}) {
        const bool trained = part == VisionGrads::Part::tower ? tower : projector;
        const auto got = grads_of(r.grads, part);
        const auto want = grads_of(all.grads, part);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          if (trained)
            EXPECT_EQ(rel_err(got[i].second, want[i].second), 0.0) << got[i].first;
          else
            EXPECT_EQ(test::max_abs(got[i].second), 0.0) << got[i].first << " is frozen";
        }
      }
    }
  for (const auto& [name, g] : all_grads)
    EXPECT_EQ(is_projector_param(name), name.find(".downsample.") != std::string::npos ||
                                            name.find(".merger.") != std::string::npos)
        << name;
}

// Recomputed blocks (VisionContext::recompute_blocks) keep their inputs only, and the backward
// reruns them with the same ops: every gradient and the pixel gradient are bit for bit those of
// the run that kept every intermediate.
TEST(VisionBackward, RecomputedBlocksGiveTheSameGradientsBitForBit) {
  const auto file = io::SafetensorsFile::open(kFixture);
  const VisionConfig config = fixture_config(file);
  for (DType dtype : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const VisionParams params = fixture_params(file, config, dtype);
    VisionBackwardOptions options;
    options.pixel_grad = true;
    const CaseRun kept = run_case(file, config, params, "multi", options);
    const CaseRun rerun = run_case(file, config, params, "multi", options, true);
    for (const VisionBlockContext& bc : rerun.context.blocks) {
      EXPECT_TRUE(bc.input.defined());
      EXPECT_FALSE(bc.qkv.defined() || bc.act.defined()) << "a recomputed block kept more";
    }
    EXPECT_EQ(rerun.d_pixels.to_doubles(), kept.d_pixels.to_doubles());
    const auto got = rerun.grads.released(config), want = kept.grads.released(config);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_EQ(got[i].second.to_doubles(), want[i].second.to_doubles()) << got[i].first;
  }
}

TEST(VisionBackward, GradientsAccumulate) {
  // A second backward into the same buffers doubles every gradient: micro-packs add up.
  const auto file = io::SafetensorsFile::open(kFixture);
  const VisionConfig config = fixture_config(file);
  const VisionParams params = fixture_params(file, config, DType::f64);
  VisionContext ctx;
  vision_forward(config, params, file.tensor("single.pixel_values"),
                 grid_from_tensor(file.tensor("single.grid_thw")), &ctx);
  VisionGrads once = VisionGrads::zeros_like(params), twice = VisionGrads::zeros_like(params);
  vision_backward(config, params, ctx, file.tensor("single.d_pooler"), once);
  for (int i = 0; i < 2; ++i)
    vision_backward(config, params, ctx, file.tensor("single.d_pooler"), twice);
  const auto a = once.released(config), b = twice.released(config);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    std::vector<double> x = a[i].second.to_doubles();
    for (double& v : x) v *= 2;
    EXPECT_LE(rel_err(Tensor::from_doubles(x, a[i].second.shape(), DType::f64), b[i].second), 1e-14)
        << a[i].first;
  }
  twice.zero();
  for (const auto& [name, g] : twice.released(config)) EXPECT_EQ(test::max_abs(g), 0.0) << name;
}

}  // namespace

// Vision tower + projector forward against transformers 5.17.0 (tiny random tower in float32 with
// eager attention, two images at once; fixture from tools/golden/vision.py), plus the properties
// the layout promises: positions and segments from grid_thw, images independent of each other.

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/config.h"
#include "glmtune/model/vision/tower.h"

namespace glmtune::model::vision {
namespace {

const std::string kFixture =
    std::string(GLMTUNE_SOURCE_DIR) + "/tests/golden/vision/tower.safetensors";

VisionConfig tiny_config() {
  const ModelConfig config = ModelConfig::preset("tiny");
  EXPECT_TRUE(config.vision().has_value());
  return *config.vision();
}

VisionParams fixture_params(const io::SafetensorsFile& file, DType dtype) {
  return VisionParams::load(
      tiny_config(),
      [&](const std::string& name) {
        return file.contains("param." + name) ? file.tensor("param." + name) : Tensor();
      },
      dtype);
}

// max |a − b| / max |b|, the relative error of docs/testing.md, "Parity measures".
double rel_error(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_doubles(), y = b.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    ref = std::max(ref, std::abs(y[i]));
  }
  return diff / ref;
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a glmtune::Error";
  return {};
}

TEST(VisionTower, TinyPresetIsTheFixtureConfig) {
  const VisionConfig c = tiny_config();
  EXPECT_EQ(c.depth, 2);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.num_heads, 2);
  EXPECT_EQ(c.intermediate_size, 64);
  EXPECT_EQ(c.out_hidden_size, 64);
  EXPECT_EQ(c.projection_intermediate_size, 96);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
}

TEST(VisionTower, ForwardMatchesReference) {
  const auto file = io::SafetensorsFile::open(kFixture);
  const VisionConfig config = tiny_config();
  const auto grid = grid_from_tensor(file.tensor("grid_thw"));
  ASSERT_EQ(grid.size(), 2u);
  const Tensor want_last = file.tensor("last_hidden_state");
  const Tensor want_pool = file.tensor("pooler_output");
  for (DType dtype : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const VisionParams params = fixture_params(file, dtype);
    const VisionOutput out = vision_forward(config, params, file.tensor("pixel_values"), grid);
    ASSERT_EQ(out.pooler_output.shape(), want_pool.shape());
    ASSERT_EQ(out.last_hidden_state.shape(), want_last.shape());
    EXPECT_LE(rel_error(out.last_hidden_state, want_last), 1e-4);
    EXPECT_LE(rel_error(out.pooler_output, want_pool), 1e-4);
  }
}

TEST(VisionTower, PositionsAndSegmentsFollowGrid) {
  const std::vector<GridThw> grid = {{1, 2, 4}, {2, 2, 2}};
  const Tensor pos = vision_position_ids(grid, 2);
  // Image 0 (2 x 4 patches): blocks (0,0) then (0,1), each (mh, mw) row-major.
  const std::vector<double> want = {0, 0, 0, 1, 1, 0, 1, 1, 0, 2, 0, 3, 1, 2, 1, 3,
                                    // image 1: one 2 x 2 block, repeated for its 2 frames
                                    0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1};
  EXPECT_EQ(pos.to_doubles(), want);
  EXPECT_EQ(vision_cu_seqlens(grid), (std::vector<int64_t>{0, 8, 12, 16}));
}

TEST(VisionTower, ImagesDoNotSeeEachOther) {
  // Fresh random pixels every run (seed printed): running two images together equals running
  // each alone, and changing one image leaves the other's output untouched.
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto file = io::SafetensorsFile::open(kFixture);
  const VisionConfig config = tiny_config();
  const VisionParams params = fixture_params(file, DType::f64);
  const std::vector<GridThw> grid = {{1, 2, 4}, {1, 4, 2}};
  auto random_rows = [&](int64_t n) {
    std::vector<double> v(size_t(n * 1176));
    for (auto& x : v) x = normal(rng);
    return Tensor::from_doubles(v, {n, 1176}, DType::f64);
  };
  const Tensor a = random_rows(8), b = random_rows(8);
  Tensor both = Tensor::empty({16, 1176}, DType::f64);
  both.slice(0, 0, 8).copy_(a);
  both.slice(0, 8, 16).copy_(b);
  const VisionOutput together = vision_forward(config, params, both, grid);
  const VisionOutput alone_a = vision_forward(config, params, a, std::vector<GridThw>{grid[0]});
  const VisionOutput alone_b = vision_forward(config, params, b, std::vector<GridThw>{grid[1]});
  EXPECT_LE(rel_error(together.pooler_output.slice(0, 0, 2), alone_a.pooler_output), 1e-12);
  EXPECT_LE(rel_error(together.pooler_output.slice(0, 2, 4), alone_b.pooler_output), 1e-12);
  // Attention does mix rows within an image: perturbing one row of image 0 changes the merged
  // token of a different merge block of the same image.
  Tensor a2 = a.clone();
  a2.set_item({0, 0}, a.item({0, 0}) + 1.0);
  const VisionOutput moved = vision_forward(config, params, a2, std::vector<GridThw>{grid[0]});
  EXPECT_GT(rel_error(moved.pooler_output.slice(0, 1, 2), alone_a.pooler_output.slice(0, 1, 2)),
            1e-9);
}

TEST(VisionTower, BadInputsAreErrors) {
  const auto file = io::SafetensorsFile::open(kFixture);
  const VisionConfig config = tiny_config();
  const VisionParams params = fixture_params(file, DType::f32);
  const Tensor rows = Tensor::zeros({8, 1176}, DType::f32);
  EXPECT_NE(error_of([&] {
              vision_forward(config, params, Tensor::zeros({8, 1175}, DType::f32),
                             std::vector<GridThw>{{1, 2, 4}});
            }).find("[N, 1176]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              vision_forward(config, params, rows, std::vector<GridThw>{{1, 2, 6}});
            }).find("covers 12 rows but there are 8"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              vision_forward(config, params, rows, std::vector<GridThw>{{1, 1, 8}});
            }).find("multiples of the merge size"),
            std::string::npos);
  // A missing or mis-shaped parameter names itself.
  const std::string missing = error_of([&] {
    VisionParams::load(
        config,
        [&](const std::string& name) {
          return name == "model.visual.blocks.1.attn.k_norm.weight" ? Tensor()
                                                                    : file.tensor("param." + name);
        },
        DType::f32);
  });
  EXPECT_NE(missing.find("model.visual.blocks.1.attn.k_norm.weight"), std::string::npos) << missing;
  const std::string misshaped = error_of([&] {
    VisionParams::load(
        config,
        [&](const std::string& name) {
          return name == "model.visual.downsample.bias" ? Tensor::zeros({63}, DType::f32)
                                                        : file.tensor("param." + name);
        },
        DType::f32);
  });
  EXPECT_NE(misshaped.find("model.visual.downsample.bias"), std::string::npos) << misshaped;
}

}  // namespace
}  // namespace glmtune::model::vision

// Vision tower + projector backward by float64 central finite differences: a random small tower
// (every parameter drawn fresh each run, seed printed on failure) on a pack of an image and a
// two-tubelet video, every parameter entry and every pixel value checked against the analytic
// gradient of ⟨dy, pooler_output⟩.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "glmtune/model/vision/tower.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::model;
using namespace glmtune::model::vision;
using namespace glmtune::test;

namespace {

VisionConfig small_config() {
  VisionConfig c;
  c.depth = 2;
  c.hidden_size = 8;
  c.num_heads = 2;
  c.intermediate_size = 12;
  c.out_hidden_size = 8;
  c.projection_intermediate_size = 12;
  c.patch_size = 2;
  c.temporal_patch_size = 2;
  c.spatial_merge_size = 2;
  c.in_channels = 3;
  c.swiglu_limit = 2.0;  // low enough that both clamps fire on O(1) projections
  return c;
}

VisionParams random_params(const VisionConfig& c, uint64_t offset) {
  const int64_t d = c.hidden_size, i = c.intermediate_size, o = c.out_hidden_size,
                p = c.projection_intermediate_size, hd = c.head_dim();
  const int64_t row = c.in_channels * c.temporal_patch_size * c.patch_size * c.patch_size;
  uint64_t next = offset;
  auto w = [&](int64_t out, int64_t in, double gain = 1.0) {
    return random_normal({out, in}, next += 1000, gain / std::sqrt(double(in)));
  };
  auto bias = [&](int64_t n) { return random_normal({n}, next += 1000, 0.1); };
  auto norm = [&](int64_t n) { return random_normal({n}, next += 1000, DType::f64, 1.0, 0.2); };
  VisionParams v;
  v.dtype = DType::f64;
  v.patch_embed.weight = w(d, row);
  v.patch_embed.bias = bias(d);
  for (int64_t l = 0; l < c.depth; ++l) {
    VisionBlockParams b;
    b.norm1 = norm(d);
    b.norm2 = norm(d);
    b.qkv.weight = w(3 * d, d, 2.0);
    b.qkv.bias = bias(3 * d);
    b.q_norm = norm(hd);
    b.k_norm = norm(hd);
    b.proj.weight = w(d, d);
    b.proj.bias = bias(d);
    b.gate.weight = w(i, d, 3.0);
    b.gate.bias = bias(i);
    b.up.weight = w(i, d, 3.0);
    b.up.bias = bias(i);
    b.down.weight = w(d, i);
    b.down.bias = bias(d);
    v.blocks.push_back(b);
  }
  v.post_layernorm = norm(d);
  v.downsample.weight = w(o, 4 * d);
  v.downsample.bias = bias(o);
  v.merger_proj.weight = w(o, o);
  v.merger_norm_w = norm(o);
  v.merger_norm_b = bias(o);
  v.merger.gate_proj.weight = w(p, o, 3.0);
  v.merger.up_proj.weight = w(p, o, 3.0);
  v.merger.down_proj.weight = w(o, p);
  return v;
}

// Smallest distance of a gate entry to the limit and of an up entry to ±limit, over every clamped
// SwiGLU of the forward; and whether each clamp fired somewhere.
struct ClampStats {
  double margin = INFINITY;
  bool gate_fired = false, up_fired = false;
};

void add_clamps(ClampStats& s, const Tensor& gate, const Tensor& up, double lim) {
  for (double g : gate.to_doubles()) {
    s.margin = std::min(s.margin, std::abs(g - lim));
    s.gate_fired |= g > lim;
  }
  for (double u : up.to_doubles()) {
    s.margin = std::min({s.margin, std::abs(u - lim), std::abs(u + lim)});
    s.up_fired |= std::abs(u) > lim;
  }
}

TEST(GradVision, FiniteDifferencesFloat64) {
  SCOPED_TRACE(seed_note());
  const VisionConfig config = small_config();
  // An image of 2 × 4 patches and a video of two tubelets of 2 × 2 patches.
  const std::vector<GridThw> grid = {{1, 2, 4}, {2, 2, 2}};
  const int64_t n = 16, row = 24;
  VisionParams params;
  Tensor pixels;
  VisionContext ctx;
  VisionOutput out;
  for (uint64_t draw = 0;; ++draw) {
    ASSERT_LT(draw, 200u) << "no draw keeps clear of the clamp bounds";
    params = random_params(config, 1000000 * (draw + 1));
    pixels = random_normal({n, row}, 1000000 * (draw + 1) + 999);
    out = vision_forward(config, params, pixels, grid, &ctx);
    ClampStats s;
    for (const VisionBlockContext& b : ctx.blocks) add_clamps(s, b.gate, b.up, config.swiglu_limit);
    add_clamps(s, ctx.merger.gate, ctx.merger.up, config.swiglu_limit);
    if (s.margin > 1e-4 && s.gate_fired && s.up_fired) break;
  }
  const Tensor dy = random_normal(out.pooler_output.shape(), 77);
  VisionGrads grads = VisionGrads::zeros_like(params);
  VisionBackwardOptions options;
  options.pixel_grad = true;
  const Tensor d_pixels = vision_backward(config, params, ctx, dy, grads, options);
  const auto loss = [&] {
    return dot(dy, vision_forward(config, params, pixels, grid).pooler_output);
  };
  EXPECT_LE(fd_rel_err(pixels, d_pixels, loss), 1e-6) << "pixel rows";

  VisionParams& g = grads.params;
  auto check = [&](Tensor& p, const Tensor& grad, const std::string& name) {
    EXPECT_LE(fd_rel_err(p, grad, loss), 1e-6) << name;
  };
  check(params.patch_embed.weight, g.patch_embed.weight, "patch_embed.weight");
  check(params.patch_embed.bias, g.patch_embed.bias, "patch_embed.bias");
  for (size_t l = 0; l < params.blocks.size(); ++l) {
    VisionBlockParams& p = params.blocks[l];
    const VisionBlockParams& b = g.blocks[l];
    const std::string at = "blocks." + std::to_string(l) + ".";
    check(p.norm1, b.norm1, at + "norm1");
    check(p.norm2, b.norm2, at + "norm2");
    check(p.qkv.weight, b.qkv.weight, at + "qkv.weight");
    check(p.qkv.bias, b.qkv.bias, at + "qkv.bias");
    check(p.q_norm, b.q_norm, at + "q_norm");
    check(p.k_norm, b.k_norm, at + "k_norm");
    check(p.proj.weight, b.proj.weight, at + "proj.weight");
    check(p.proj.bias, b.proj.bias, at + "proj.bias");
    check(p.gate.weight, b.gate.weight, at + "gate.weight");
    check(p.gate.bias, b.gate.bias, at + "gate.bias");
    check(p.up.weight, b.up.weight, at + "up.weight");
    check(p.up.bias, b.up.bias, at + "up.bias");
    check(p.down.weight, b.down.weight, at + "down.weight");
    check(p.down.bias, b.down.bias, at + "down.bias");
  }
  check(params.post_layernorm, g.post_layernorm, "post_layernorm");
  check(params.downsample.weight, g.downsample.weight, "downsample.weight");
  check(params.downsample.bias, g.downsample.bias, "downsample.bias");
  check(params.merger_proj.weight, g.merger_proj.weight, "merger.proj");
  check(params.merger_norm_w, g.merger_norm_w, "merger.norm.weight");
  check(params.merger_norm_b, g.merger_norm_b, "merger.norm.bias");
  check(params.merger.gate_proj.weight, g.merger.gate_proj.weight, "merger.gate");
  check(params.merger.up_proj.weight, g.merger.up_proj.weight, "merger.up");
  check(params.merger.down_proj.weight, g.merger.down_proj.weight, "merger.down");
}

TEST(GradVision, SegmentsAreIndependent) {
  // The gradient of one image's output never reaches another image's pixels, nor one tubelet's
  // the other tubelet's: each is its own attention segment.
  SCOPED_TRACE(seed_note());
  const VisionConfig config = small_config();
  const std::vector<GridThw> grid = {{1, 2, 4}, {2, 2, 2}};
  const VisionParams params = random_params(config, 5000000);
  const Tensor pixels = random_normal({16, 24}, 5000999);
  VisionContext ctx;
  const VisionOutput out = vision_forward(config, params, pixels, grid, &ctx);
  // Upstream gradient on the merged tokens of the first tubelet only (merged rows 2 and 3).
  Tensor dy = Tensor::zeros(out.pooler_output.shape(), DType::f64);
  dy.slice(0, 2, 3).copy_(random_normal({1, config.out_hidden_size}, 5001999));
  VisionGrads grads = VisionGrads::zeros_like(params);
  VisionBackwardOptions options;
  options.pixel_grad = true;
  const Tensor d_pixels = vision_backward(config, params, ctx, dy, grads, options);
  EXPECT_EQ(max_abs(d_pixels.slice(0, 0, 8)), 0.0) << "the image";
  EXPECT_GT(max_abs(d_pixels.slice(0, 8, 12)), 0.0) << "the first tubelet";
  EXPECT_EQ(max_abs(d_pixels.slice(0, 12, 16)), 0.0) << "the second tubelet";
}

}  // namespace

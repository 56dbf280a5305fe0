#include "glmtune/model/vision/tower.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/norm.h"

namespace glmtune::model::vision {
namespace {

const std::string kPrefix = "model.visual.";

// Rows of a query block scored at once: bounds the score buffer to kQueryBlock × segment length,
// so that a full-resolution image (tens of thousands of rows) never needs a square matrix.
constexpr int64_t kQueryBlock = 256;

Tensor fetch(const std::function<Tensor(const std::string&)>& get, const std::string& name,
             const Shape& shape, DType dtype) {
  Tensor t = get(kPrefix + name);
  if (!t.defined())
    throw Error(fmt::format("missing vision parameter `{}{}`", kPrefix, name), "vision tower",
                "load a checkpoint that includes the vision tower");
  if (t.shape() != shape)
    throw Error(fmt::format("vision parameter `{}{}` has shape {}, expected {}", kPrefix, name,
                            shape_str(t.shape()), shape_str(shape)),
                "vision tower", "check that the checkpoint matches its config.json vision_config");
  if (!dtype_is_floating(t.dtype()))
    throw Error(fmt::format("vision parameter `{}{}` is {}, not a floating type", kPrefix, name,
                            dtype_name(t.dtype())),
                "vision tower");
  return t.to(dtype).contiguous();
}

template <typename T>
struct Rope {
  std::vector<T> cos, sin;  // [N, hd]
};

// cos/sin tables of the 2-D axial rotary embedding. With hd the head dim and q = hd/4:
// inv_freq[k] = 1 / θ^(2k / (hd/2)) for k < q, angles [h·inv_freq, w·inv_freq] (hd/2 values),
// repeated twice to cover the head dim (rotate-half pairs m with m + hd/2). In f32 the steps
// round as the reference's float32 tensors do.
template <typename T>
Rope<T> rope_tables(const Tensor& positions, int64_t hd, double theta) {
  const int64_t n = positions.size(0);
  const int64_t quarter = hd / 4, half = hd / 2;
  std::vector<T> inv_freq(static_cast<size_t>(quarter));
  for (int64_t k = 0; k < quarter; ++k) {
    const T exponent = T(2 * k) / T(half);
    inv_freq[size_t(k)] = T(1) / std::pow(T(theta), exponent);
  }
  Rope<T> rope;
  rope.cos.resize(size_t(n * hd));
  rope.sin.resize(size_t(n * hd));
  const int64_t* pos = positions.data<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    T* c = &rope.cos[size_t(r * hd)];
    T* s = &rope.sin[size_t(r * hd)];
    for (int axis = 0; axis < 2; ++axis) {
      const T p = T(pos[r * 2 + axis]);
      for (int64_t k = 0; k < quarter; ++k) {
        const T angle = p * inv_freq[size_t(k)];
        const int64_t m = axis * quarter + k;
        c[m] = c[m + half] = std::cos(angle);
        s[m] = s[m + half] = std::sin(angle);
      }
    }
  }
  return rope;
}

// x [N, H, hd] in place: x'[m] = x[m]·cos − x[m+hd/2]·sin, x'[m+hd/2] = x[m+hd/2]·cos + x[m]·sin.
template <typename T>
void apply_rope(T* x, int64_t n, int64_t heads, int64_t hd, const Rope<T>& rope) {
  const int64_t half = hd / 2;
  for (int64_t r = 0; r < n; ++r) {
    const T* c = &rope.cos[size_t(r * hd)];
    const T* s = &rope.sin[size_t(r * hd)];
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + (r * heads + h) * hd;
      for (int64_t m = 0; m < half; ++m) {
        const T a = v[m], b = v[m + half];
        v[m] = a * c[m] - b * s[m];
        v[m + half] = b * c[m + half] + a * s[m + half];
      }
    }
  }
}

// Full softmax attention of every segment with itself, per head. q, k, v, out are [N, H·hd]
// row-major (v may have a wider row stride). Scores accumulate in T, the softmax normaliser in
// double.
template <typename T>
void segment_attention(const T* q, const T* k, const T* v, int64_t v_stride, T* out, int64_t heads,
                       int64_t hd, const std::vector<int64_t>& cu_seqlens, double scale) {
  const int64_t d = heads * hd;
  std::vector<T> scores;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t start = cu_seqlens[s], len = cu_seqlens[s + 1] - start;
    if (len == 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const T* qh = q + start * d + h * hd;
      const T* kh = k + start * d + h * hd;
      const T* vh = v + start * v_stride + h * hd;
      T* oh = out + start * d + h * hd;
      for (int64_t q0 = 0; q0 < len; q0 += kQueryBlock) {
        const int64_t rows = std::min(kQueryBlock, len - q0);
        scores.resize(size_t(rows * len));
        ops::gemm<T>(false, true, rows, len, hd, T(scale), qh + q0 * d, d, kh, d, T(0),
                     scores.data(), len);
        for (int64_t i = 0; i < rows; ++i) {
          T* row = &scores[size_t(i * len)];
          const T mx = *std::max_element(row, row + len);
          double sum = 0.0;
          for (int64_t j = 0; j < len; ++j) {
            row[j] = std::exp(row[j] - mx);
            sum += double(row[j]);
          }
          const T inv = T(1.0 / sum);
          for (int64_t j = 0; j < len; ++j) row[j] *= inv;
        }
        ops::gemm<T>(false, false, rows, hd, len, T(1), scores.data(), len, vh, v_stride, T(0),
                     oh + q0 * d, d);
      }
    }
  }
}

// Exact GELU, x·Φ(x) = x/2 · (1 + erf(x/√2)), in place.
template <typename T>
void gelu_erf(Tensor& x) {
  T* p = x.data<T>();
  const int64_t n = x.numel();
  constexpr double inv_sqrt2 = 0.70710678118654752440;
  for (int64_t i = 0; i < n; ++i) p[i] = T(0.5) * p[i] * (T(1) + std::erf(p[i] * T(inv_sqrt2)));
}

void check_inputs(const VisionConfig& config, const Tensor& pixel_rows,
                  std::span<const GridThw> grid) {
  const int64_t row =
      config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size;
  if (pixel_rows.dim() != 2 || pixel_rows.size(1) != row)
    throw Error(fmt::format("pixel rows have shape {}, expected [N, {}]",
                            shape_str(pixel_rows.shape()), row),
                "vision tower", "pass the image processor's pixel_values");
  if (!dtype_is_floating(pixel_rows.dtype()))
    throw Error("pixel rows must be a floating-point tensor", "vision tower");
  if (grid.empty()) throw Error("grid_thw is empty", "vision tower");
  const int64_t m = config.spatial_merge_size;
  int64_t total = 0;
  for (size_t g = 0; g < grid.size(); ++g) {
    const auto [t, h, w] = grid[g];
    if (t <= 0 || h <= 0 || w <= 0 || h % m != 0 || w % m != 0)
      throw Error(fmt::format("grid_thw row {} is ({}, {}, {}): t, h, w must be positive and h, w "
                              "multiples of the merge size {}",
                              g, t, h, w, m),
                  "vision tower");
    total += t * h * w;
  }
  if (total != pixel_rows.size(0))
    throw Error(fmt::format("grid_thw covers {} rows but there are {} pixel rows", total,
                            pixel_rows.size(0)),
                "vision tower", "pass the pixel_values and image_grid_thw of the same images");
}

template <typename T>
VisionOutput forward_impl(const VisionConfig& config, const VisionParams& params,
                          const Tensor& pixel_rows, std::span<const GridThw> grid) {
  const int64_t n = pixel_rows.size(0);
  const int64_t d = config.hidden_size, heads = config.num_heads, hd = config.head_dim();
  const double eps = config.rms_norm_eps, limit = config.swiglu_limit;
  const std::vector<int64_t> cu_seqlens = vision_cu_seqlens(grid);
  const Rope<T> rope =
      rope_tables<T>(vision_position_ids(grid, config.spatial_merge_size), hd, config.rope_theta);

  Tensor x = ops::linear(pixel_rows.to(params.dtype).contiguous(), params.patch_embed_w,
                         params.patch_embed_b);
  for (const VisionBlockParams& b : params.blocks) {
    const Tensor a = ops::rms_norm(x, b.norm1, eps);
    const Tensor qkv = ops::linear(a, b.qkv_w, b.qkv_b);  // [N, 3D]
    // Q and K: per-head RMSNorm over the head dim (one weight for all heads), then the rotation.
    Tensor q = ops::rms_norm(qkv.slice(1, 0, d).contiguous().view({n * heads, hd}), b.q_norm, eps);
    Tensor k =
        ops::rms_norm(qkv.slice(1, d, 2 * d).contiguous().view({n * heads, hd}), b.k_norm, eps);
    apply_rope<T>(q.data<T>(), n, heads, hd, rope);
    apply_rope<T>(k.data<T>(), n, heads, hd, rope);
    Tensor attn = Tensor::empty({n, d}, params.dtype);
    segment_attention<T>(q.data<T>(), k.data<T>(), qkv.data<T>() + 2 * d, 3 * d, attn.data<T>(),
                         heads, hd, cu_seqlens, 1.0 / std::sqrt(double(hd)));
    ops::linear_out(x, attn, b.proj_w, b.proj_b, /*accumulate=*/true);

    const Tensor m = ops::rms_norm(x, b.norm2, eps);
    const Tensor z = ops::swiglu_clamped(ops::linear(m, b.gate_w, b.gate_b),
                                         ops::linear(m, b.up_w, b.up_b), limit);
    ops::linear_out(x, z, b.down_w, b.down_b, /*accumulate=*/true);
  }
  x = ops::rms_norm(x, params.post_layernorm, eps);
  const int64_t merge = config.spatial_merge_size * config.spatial_merge_size;
  VisionOutput out;
  out.last_hidden_state =
      ops::linear(x.view({n / merge, merge * d}), params.downsample_w, params.downsample_b);
  Tensor h = ops::linear(out.last_hidden_state, params.merger_proj);
  h = ops::layer_norm(h, params.merger_norm_w, params.merger_norm_b, 1e-5);
  gelu_erf<T>(h);
  ops::MlpParams mlp{params.merger_gate, params.merger_up, params.merger_down};
  out.pooler_output = ops::mlp_forward(mlp, h, limit);
  return out;
}

}  // namespace

VisionParams VisionParams::load(const VisionConfig& c,
                                const std::function<Tensor(const std::string&)>& get, DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f64)
    throw InternalError(
        fmt::format("vision tower computes in f32 or f64, not {}", dtype_name(dtype)));
  const int64_t d = c.hidden_size, i = c.intermediate_size, o = c.out_hidden_size,
                p = c.projection_intermediate_size, hd = c.head_dim();
  const int64_t m = c.spatial_merge_size;
  if (d % c.num_heads != 0 || hd % 4 != 0)
    throw Error(fmt::format("vision hidden_size {} must split into num_heads {} heads of a width "
                            "divisible by 4 (2-D rotary embedding)",
                            d, c.num_heads),
                "vision_config");
  VisionParams v;
  v.dtype = dtype;
  const int64_t row = c.in_channels * c.temporal_patch_size * c.patch_size * c.patch_size;
  v.patch_embed_w =
      fetch(get, "patch_embed.proj.weight",
            {d, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size}, dtype)
          .view({d, row});
  v.patch_embed_b = fetch(get, "patch_embed.proj.bias", {d}, dtype);
  for (int64_t l = 0; l < c.depth; ++l) {
    const std::string b = fmt::format("blocks.{}.", l);
    VisionBlockParams bp;
    bp.norm1 = fetch(get, b + "norm1.weight", {d}, dtype);
    bp.norm2 = fetch(get, b + "norm2.weight", {d}, dtype);
    bp.qkv_w = fetch(get, b + "attn.qkv.weight", {3 * d, d}, dtype);
    bp.q_norm = fetch(get, b + "attn.q_norm.weight", {hd}, dtype);
    bp.k_norm = fetch(get, b + "attn.k_norm.weight", {hd}, dtype);
    bp.proj_w = fetch(get, b + "attn.proj.weight", {d, d}, dtype);
    bp.gate_w = fetch(get, b + "mlp.gate_proj.weight", {i, d}, dtype);
    bp.up_w = fetch(get, b + "mlp.up_proj.weight", {i, d}, dtype);
    bp.down_w = fetch(get, b + "mlp.down_proj.weight", {d, i}, dtype);
    if (c.attention_bias) {
      bp.qkv_b = fetch(get, b + "attn.qkv.bias", {3 * d}, dtype);
      bp.proj_b = fetch(get, b + "attn.proj.bias", {d}, dtype);
      bp.gate_b = fetch(get, b + "mlp.gate_proj.bias", {i}, dtype);
      bp.up_b = fetch(get, b + "mlp.up_proj.bias", {i}, dtype);
      bp.down_b = fetch(get, b + "mlp.down_proj.bias", {d}, dtype);
    }
    v.blocks.push_back(std::move(bp));
  }
  v.post_layernorm = fetch(get, "post_layernorm.weight", {d}, dtype);
  // [O, D, kh, kw] -> [O, kh, kw, D] -> [O, 4D]: column (kh·m + kw)·D + c.
  v.downsample_w = fetch(get, "downsample.weight", {o, d, m, m}, dtype)
                       .permute({0, 2, 3, 1})
                       .contiguous()
                       .view({o, m * m * d});
  v.downsample_b = fetch(get, "downsample.bias", {o}, dtype);
  v.merger_proj = fetch(get, "merger.proj.weight", {o, o}, dtype);
  v.merger_norm_w = fetch(get, "merger.post_projection_norm.weight", {o}, dtype);
  v.merger_norm_b = fetch(get, "merger.post_projection_norm.bias", {o}, dtype);
  v.merger_gate = fetch(get, "merger.gate_proj.weight", {p, o}, dtype);
  v.merger_up = fetch(get, "merger.up_proj.weight", {p, o}, dtype);
  v.merger_down = fetch(get, "merger.down_proj.weight", {o, p}, dtype);
  return v;
}

VisionParams VisionParams::from_store(const ParamStore& store, DType dtype) {
  const auto& vision = store.config().vision();
  if (!vision) throw Error("the model config has no vision_config", store.config().source());
  return load(
      *vision,
      [&](const std::string& name) { return store.contains(name) ? store.get(name) : Tensor(); },
      dtype);
}

std::vector<GridThw> grid_from_tensor(const Tensor& grid_thw) {
  if (grid_thw.dim() != 2 || grid_thw.size(1) != 3)
    throw Error(fmt::format("grid_thw has shape {}, expected [G, 3]", shape_str(grid_thw.shape())),
                "vision tower");
  const std::vector<double> values = grid_thw.to_doubles();
  std::vector<GridThw> grid(size_t(grid_thw.size(0)));
  for (size_t g = 0; g < grid.size(); ++g)
    for (size_t j = 0; j < 3; ++j) grid[g][j] = int64_t(values[g * 3 + j]);
  return grid;
}

Tensor vision_position_ids(std::span<const GridThw> grid, int64_t merge_size) {
  int64_t total = 0;
  for (const auto& [t, h, w] : grid) total += t * h * w;
  Tensor pos = Tensor::empty({total, 2}, DType::i64);
  int64_t* p = pos.data<int64_t>();
  for (const auto& [t, h, w] : grid) {
    for (int64_t f = 0; f < t; ++f)
      for (int64_t bh = 0; bh < h / merge_size; ++bh)
        for (int64_t bw = 0; bw < w / merge_size; ++bw)
          for (int64_t mh = 0; mh < merge_size; ++mh)
            for (int64_t mw = 0; mw < merge_size; ++mw) {
              *p++ = bh * merge_size + mh;
              *p++ = bw * merge_size + mw;
            }
  }
  return pos;
}

std::vector<int64_t> vision_cu_seqlens(std::span<const GridThw> grid) {
  std::vector<int64_t> cu{0};
  for (const auto& [t, h, w] : grid)
    for (int64_t f = 0; f < t; ++f) cu.push_back(cu.back() + h * w);
  return cu;
}

VisionOutput vision_forward(const VisionConfig& config, const VisionParams& params,
                            const Tensor& pixel_rows, std::span<const GridThw> grid) {
  check_inputs(config, pixel_rows, grid);
  if (int64_t(params.blocks.size()) != config.depth)
    throw InternalError(fmt::format("vision params hold {} blocks, config depth is {}",
                                    params.blocks.size(), config.depth));
  if (params.dtype == DType::f64) return forward_impl<double>(config, params, pixel_rows, grid);
  return forward_impl<float>(config, params, pixel_rows, grid);
}

}  // namespace glmtune::model::vision

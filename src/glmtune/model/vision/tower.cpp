#include "glmtune/model/vision/tower.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/norm.h"
#include "glmtune/ops/vision.h"

namespace glmtune::model::vision {
namespace {

const std::string kPrefix = "model.visual.";

// torch.nn.LayerNorm's default, which the merger's post_projection_norm keeps.
constexpr double kLayerNormEps = 1e-5;

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

void check_inputs(const VisionConfig& config, const Tensor& pixel_rows,
                  std::span<const GridThw> grid, const VisionShard* shard) {
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
  if (shard) {
    int64_t shards = 0;
    for (int64_t c : shard->patch_counts) shards += c;
    GLMTUNE_ASSERT(shards == total && pixel_rows.size(0) == shard->patches(),
                   "a shard of {} pixel rows, expected {} of the {} rows grid_thw covers (shards "
                   "of {} rows)",
                   pixel_rows.size(0), shard->patches(), total, shards);
    return;
  }
  if (total != pixel_rows.size(0))
    throw Error(fmt::format("grid_thw covers {} rows but there are {} pixel rows", total,
                            pixel_rows.size(0)),
                "vision tower", "pass the pixel_values and image_grid_thw of the same images");
}

// Rotary positions of the rows held here: the whole pack's, or the shard's range of them.
Tensor local_positions(std::span<const GridThw> grid, int64_t merge_size,
                       const VisionShard* shard) {
  const Tensor all = vision_position_ids(grid, merge_size);
  if (!shard) return all;
  return all.narrow(0, shard->patch_begin, shard->patches()).contiguous();
}

// The rotary tables of the rows held here, where the rotation runs: in the compute dtype on the
// CPU, in f32 on the parameters' GPU.
ops::RopeTables rope_tables(const VisionConfig& config, const VisionParams& params,
                            std::span<const GridThw> grid, const VisionShard* shard) {
  const bool gpu = params.device.is_cuda();
  ops::RopeTables t =
      ops::rope_2d_tables(local_positions(grid, config.spatial_merge_size, shard),
                          config.head_dim(), config.rope_theta, gpu ? DType::f32 : params.dtype);
  if (gpu) t = {t.cos.to(params.device), t.sin.to(params.device)};
  return t;
}

// One block's forward from its input x [N, D] (updated in place to the block's output), keeping
// the backward's intermediates in `bc` when given.
void block_forward(const VisionConfig& config, const VisionBlockParams& b, Tensor& x,
                   const ops::RopeTables& rope, const std::vector<int64_t>& cu_seqlens,
                   const VisionShard* shard, VisionBlockContext* bc) {
  const int64_t n = x.size(0);
  const int64_t d = config.hidden_size, heads = config.num_heads, hd = config.head_dim();
  const double eps = config.rms_norm_eps, limit = config.swiglu_limit;
  const int64_t row0 = shard ? shard->patch_begin : 0;
  const Tensor a = ops::rms_norm(x, b.norm1, eps, bc ? &bc->rstd1 : nullptr);
  const Tensor qkv = ops::linear(a, b.qkv);  // [N, 3D]
  // Q and K: per-head RMSNorm over the head dim (one weight for all heads), then the rotation.
  Tensor q = ops::rms_norm(qkv.slice(1, 0, d).contiguous().view({n * heads, hd}), b.q_norm, eps,
                           bc ? &bc->q_rstd : nullptr);
  Tensor k = ops::rms_norm(qkv.slice(1, d, 2 * d).contiguous().view({n * heads, hd}), b.k_norm, eps,
                           bc ? &bc->k_rstd : nullptr);
  ops::rope_2d_(q, rope);
  ops::rope_2d_(k, rope);
  const double scale = 1.0 / std::sqrt(double(hd));
  Tensor k_all, v_all, attn;
  if (shard) {
    // The local queries attend to their segments' keys and values wherever these were computed.
    k_all = shard->exchange->gather_rows(k.view({n, d}), shard->patch_counts);
    v_all =
        shard->exchange->gather_rows(qkv.slice(1, 2 * d, 3 * d).contiguous(), shard->patch_counts);
    attn = ops::varlen_attention(q.view({n, d}), k_all, v_all, cu_seqlens, heads, scale, row0,
                                 bc ? &bc->attn_lse : nullptr);
  } else {
    attn = ops::varlen_attention(q.view({n, d}), k.view({n, d}), qkv.slice(1, 2 * d, 3 * d),
                                 cu_seqlens, heads, scale, 0, bc ? &bc->attn_lse : nullptr);
  }
  ops::linear_out(x, attn, b.proj.weight, b.proj.bias, /*accumulate=*/true);

  const Tensor m = ops::rms_norm(x, b.norm2, eps, bc ? &bc->rstd2 : nullptr);
  Tensor gate = ops::linear(m, b.gate), up = ops::linear(m, b.up);
  const Tensor z = ops::swiglu_clamped(gate, up, limit);
  if (bc) {
    bc->normed1 = a;
    bc->qkv = qkv;
    bc->q = q;
    bc->k = k;
    bc->attn = attn;
    bc->mid = x.clone();
    bc->normed2 = m;
    bc->gate = gate;
    bc->up = up;
    bc->act = z;
    bc->k_all = k_all;
    bc->v_all = v_all;
  }
  ops::linear_out(x, z, b.down.weight, b.down.bias, /*accumulate=*/true);
}

// The tower is written once on the ops (f32 or f64 on the CPU; ops/vision.h for its own).
VisionOutput forward_impl(const VisionConfig& config, const VisionParams& params,
                          const Tensor& pixel_rows, std::span<const GridThw> grid,
                          VisionContext* ctx, const VisionShard* shard) {
  const int64_t n = pixel_rows.size(0), d = config.hidden_size;
  const double eps = config.rms_norm_eps, limit = config.swiglu_limit;
  const std::vector<int64_t> cu_seqlens = vision_cu_seqlens(grid);
  const ops::RopeTables rope = rope_tables(config, params, grid, shard);

  const Tensor pixels = pixel_rows.to(params.device).to(params.dtype).contiguous();
  Tensor x = ops::linear(pixels, params.patch_embed);
  if (ctx) {
    ctx->grid.assign(grid.begin(), grid.end());
    ctx->shard = shard ? *shard : VisionShard{};
    ctx->pixels = pixels;
    ctx->blocks.clear();
  }
  for (const VisionBlockParams& b : params.blocks) {
    VisionBlockContext bc;
    if (ctx) bc.input = x.clone();
    // Recomputed blocks keep their input only; the backward reruns them (block_forward).
    block_forward(config, b, x, rope, cu_seqlens, shard,
                  ctx && !ctx->recompute_blocks ? &bc : nullptr);
    if (ctx) ctx->blocks.push_back(std::move(bc));
  }
  if (ctx) ctx->final_hidden = x;
  x = ops::rms_norm(x, params.post_layernorm, eps, ctx ? &ctx->post_rstd : nullptr);
  const int64_t merge = config.spatial_merge_size * config.spatial_merge_size;
  VisionOutput out;
  // Each merge block's four rows, channel-major (column c·4 + k), so that the Conv2d weight
  // [O, D, 2, 2] is the GEMM's weight as stored.
  const Tensor merged =
      x.view({n / merge, merge, d}).transpose(1, 2).contiguous().view({n / merge, d * merge});
  out.last_hidden_state = ops::linear(merged, params.downsample);
  const Tensor projected = ops::linear(out.last_hidden_state, params.merger_proj);
  Tensor h = ops::layer_norm(projected, params.merger_norm_w, params.merger_norm_b, kLayerNormEps,
                             ctx ? &ctx->ln_mean : nullptr, ctx ? &ctx->ln_rstd : nullptr);
  if (ctx) ctx->ln_out = h.clone();
  ops::gelu_erf_(h);
  if (ctx) {
    ctx->merged = merged;
    ctx->downsampled = out.last_hidden_state;
    ctx->projected = projected;
    out.pooler_output = ops::mlp_forward(params.merger, h, limit, ctx->merger);
  } else {
    out.pooler_output = ops::mlp_forward(params.merger, h, limit);
  }
  return out;
}

// ---- Backward helpers -------------------------------------------------------------------------

Tensor backward_impl(const VisionConfig& config, const VisionParams& params,
                     const VisionContext& ctx, const Tensor& d_pooler, VisionGrads& grads,
                     const VisionBackwardOptions& options) {
  const int64_t n = ctx.pixels.size(0);
  const int64_t d = config.hidden_size, heads = config.num_heads, hd = config.head_dim();
  const double eps = config.rms_norm_eps, limit = config.swiglu_limit;
  const int64_t merge = config.spatial_merge_size * config.spatial_merge_size;
  VisionParams& g = grads.params;
  const bool proj = options.train_projector;
  auto grad_of = [](bool train, Tensor& t) { return train ? &t : nullptr; };

  // Merger: clamped SwiGLU <- GELU <- LayerNorm <- proj; then the downsample.
  const bool need_dx = options.train_tower || options.pixel_grad;
  if (!proj && !need_dx) return Tensor();
  const Tensor dy = d_pooler.to(params.device).to(params.dtype).contiguous();
  Tensor dh;
  if (proj) {
    dh = ops::mlp_backward(params.merger, ctx.merger, dy, limit, g.merger);
  } else {
    // Frozen projector: the same chain without any weight gradient.
    const Tensor act = ops::swiglu_clamped(ctx.merger.gate, ctx.merger.up, limit);
    Tensor dgate, dup;
    ops::swiglu_clamped_backward(ctx.merger.gate, ctx.merger.up,
                                 ops::linear_backward(dy, act, params.merger.down_proj, nullptr),
                                 limit, dgate, dup);
    dh = ops::linear_backward(dgate, ctx.merger.x, params.merger.gate_proj, nullptr);
    ops::add_into(dh, ops::linear_backward(dup, ctx.merger.x, params.merger.up_proj, nullptr));
  }
  ops::gelu_erf_backward_(ctx.ln_out, dh);
  dh = ops::layer_norm_backward(dh, ctx.projected, params.merger_norm_w, kLayerNormEps, ctx.ln_mean,
                                ctx.ln_rstd, grad_of(proj, g.merger_norm_w),
                                grad_of(proj, g.merger_norm_b));
  dh = ops::linear_backward(dh, ctx.downsampled, params.merger_proj,
                            proj ? &g.merger_proj : nullptr);
  Tensor dx = ops::linear_backward(dh, ctx.merged, params.downsample,
                                   proj ? &g.downsample : nullptr, need_dx);
  if (!need_dx) return Tensor();
  dx = dx.view({n / merge, d, merge}).transpose(1, 2).contiguous().view({n, d});

  const bool tower = options.train_tower;
  dx = ops::rms_norm_backward(dx, ctx.final_hidden, params.post_layernorm, eps, ctx.post_rstd,
                              grad_of(tower, g.post_layernorm));
  const std::vector<int64_t> cu_seqlens = vision_cu_seqlens(ctx.grid);
  const VisionShard* shard = ctx.shard.exchange ? &ctx.shard : nullptr;
  const ops::RopeTables rope = rope_tables(config, params, ctx.grid, shard);
  const double scale = 1.0 / std::sqrt(double(hd));
  for (int64_t l = int64_t(params.blocks.size()) - 1; l >= 0; --l) {
    const VisionBlockParams& b = params.blocks[size_t(l)];
    // A recomputed block kept its input only: rerun it (the same ops, so the same values).
    VisionBlockContext rerun;
    if (!ctx.blocks[size_t(l)].qkv.defined()) {
      rerun.input = ctx.blocks[size_t(l)].input;
      Tensor x = rerun.input.clone();
      block_forward(config, b, x, rope, cu_seqlens, shard, &rerun);
    }
    const VisionBlockContext& bc = rerun.input.defined() ? rerun : ctx.blocks[size_t(l)];
    VisionBlockParams& bg = g.blocks[size_t(l)];
    // MLP branch: x_out = mid + down(act(gate(m), up(m))), m = norm2(mid).
    const Tensor dact = ops::linear_backward(dx, bc.act, b.down, tower ? &bg.down : nullptr);
    Tensor dgate, dup;
    ops::swiglu_clamped_backward(bc.gate, bc.up, dact, limit, dgate, dup);
    Tensor dm = ops::linear_backward(dgate, bc.normed2, b.gate, tower ? &bg.gate : nullptr);
    ops::add_into(dm, ops::linear_backward(dup, bc.normed2, b.up, tower ? &bg.up : nullptr));
    ops::add_into(
        dx, ops::rms_norm_backward(dm, bc.mid, b.norm2, eps, bc.rstd2, grad_of(tower, bg.norm2)));

    // Attention branch: mid = input + proj(attn(rope(qnorm(Q)), rope(knorm(K)), V)).
    const Tensor dattn = ops::linear_backward(dx, bc.attn, b.proj, tower ? &bg.proj : nullptr);
    Tensor dq, dk;
    Tensor dqkv = Tensor::empty({n, 3 * d}, params.dtype, params.device);
    if (shard) {
      // Every rank's queries add into the keys' and values' gradients of the whole pack; each
      // rank then takes its rows' sums.
      ops::VarlenAttentionGrads ga =
          ops::varlen_attention_backward(bc.q.view({n, d}), bc.k_all, bc.v_all, bc.attn, dattn,
                                         cu_seqlens, heads, scale, shard->patch_begin, bc.attn_lse);
      dq = std::move(ga.dq);
      dk = shard->exchange->sum_scatter_rows(ga.dk, shard->patch_counts);
      dqkv.slice(1, 2 * d, 3 * d)
          .copy_(shard->exchange->sum_scatter_rows(ga.dv, shard->patch_counts));
    } else {
      ops::VarlenAttentionGrads ga = ops::varlen_attention_backward(
          bc.q.view({n, d}), bc.k.view({n, d}), bc.qkv.slice(1, 2 * d, 3 * d), bc.attn, dattn,
          cu_seqlens, heads, scale, 0, bc.attn_lse);
      dq = std::move(ga.dq);
      dk = std::move(ga.dk);
      dqkv.slice(1, 2 * d, 3 * d).copy_(ga.dv);
    }
    dq = dq.view({n * heads, hd});
    dk = dk.view({n * heads, hd});
    ops::rope_2d_backward_(dq, rope);
    ops::rope_2d_backward_(dk, rope);
    const Tensor dq_raw =
        ops::rms_norm_backward(dq, bc.qkv.slice(1, 0, d).contiguous().view({n * heads, hd}),
                               b.q_norm, eps, bc.q_rstd, grad_of(tower, bg.q_norm));
    const Tensor dk_raw =
        ops::rms_norm_backward(dk, bc.qkv.slice(1, d, 2 * d).contiguous().view({n * heads, hd}),
                               b.k_norm, eps, bc.k_rstd, grad_of(tower, bg.k_norm));
    dqkv.slice(1, 0, d).copy_(dq_raw.view({n, d}));
    dqkv.slice(1, d, 2 * d).copy_(dk_raw.view({n, d}));
    const Tensor da = ops::linear_backward(dqkv, bc.normed1, b.qkv, tower ? &bg.qkv : nullptr);
    ops::add_into(
        dx, ops::rms_norm_backward(da, bc.input, b.norm1, eps, bc.rstd1, grad_of(tower, bg.norm1)));
  }
  return ops::linear_backward(dx, ctx.pixels, params.patch_embed, tower ? &g.patch_embed : nullptr,
                              options.pixel_grad);
}

}  // namespace

VisionParams VisionParams::load(const VisionConfig& c,
                                const std::function<Tensor(const std::string&)>& get, DType dtype,
                                Device device) {
  if (device.is_cuda() ? dtype != DType::bf16 : dtype != DType::f32 && dtype != DType::f64)
    throw InternalError(
        fmt::format("the vision tower computes in f32 or f64 on the CPU and in "
                    "bf16 on a GPU, not in {} on {}",
                    dtype_name(dtype), device.str()));
  const int64_t d = c.hidden_size, o = c.out_hidden_size, hd = c.head_dim();
  if (d % c.num_heads != 0 || hd % 4 != 0)
    throw Error(fmt::format("vision hidden_size {} must split into num_heads {} heads of a width "
                            "divisible by 4 (2-D rotary embedding)",
                            d, c.num_heads),
                "vision_config");
  VisionParams v;
  v.dtype = dtype;
  const VisionParams released = shapes(c);
  v.blocks.resize(released.blocks.size());
  zip_vision_params(released, v, [&](const std::string& name, const Tensor& shape, Tensor& field) {
    if (shape.defined()) field = fetch(get, name, shape.shape(), dtype);
  });
  // The convolutions as GEMMs: the patch embedding [D, C, T, p, p] as [D, C·T·p·p], the downsample
  // [O, D, kh, kw] as [O, 4D] (column c·4 + kh·2 + kw, the merged rows' order).
  v.patch_embed.weight = v.patch_embed.weight.view({d, -1});
  v.downsample.weight = v.downsample.weight.view({o, -1});
  if (device.is_cuda()) {
    v.device = device;
    zip_vision_params(v, v, [&](const std::string&, Tensor& t, Tensor&) {
      if (t.defined()) t = t.to(device);
    });
  }
  return v;
}

VisionParams VisionParams::shapes(const VisionConfig& c) {
  const int64_t W = c.hidden_size, I = c.intermediate_size, O = c.out_hidden_size,
                m = c.spatial_merge_size;
  const auto projection = [&](int64_t out, int64_t in) {
    return ops::Linear(model::shape_only({out, in}),
                       c.attention_bias ? model::shape_only({out}) : Tensor());
  };
  VisionParams p;
  p.patch_embed = ops::Linear(
      model::shape_only({W, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size}),
      model::shape_only({W}));
  p.blocks.resize(size_t(c.depth));
  for (VisionBlockParams& b : p.blocks) {
    b.norm1 = model::shape_only({W});
    b.norm2 = model::shape_only({W});
    b.qkv = projection(3 * W, W);
    b.q_norm = model::shape_only({c.head_dim()});
    b.k_norm = model::shape_only({c.head_dim()});
    b.proj = projection(W, W);
    b.gate = projection(I, W);
    b.up = projection(I, W);
    b.down = projection(W, I);
  }
  p.post_layernorm = model::shape_only({W});
  p.downsample = ops::Linear(model::shape_only({O, W, m, m}), model::shape_only({O}));
  // The merger's projections have no bias, whatever attention_bias says.
  p.merger_proj = ops::Linear(model::shape_only({O, O}));
  p.merger_norm_w = model::shape_only({O});
  p.merger_norm_b = model::shape_only({O});
  const int64_t P = c.projection_intermediate_size;
  p.merger.gate_proj = ops::Linear(model::shape_only({P, O}));
  p.merger.up_proj = ops::Linear(model::shape_only({P, O}));
  p.merger.down_proj = ops::Linear(model::shape_only({O, P}));
  return p;
}

VisionParams VisionParams::from_store(const ParamStore& store, DType dtype, Device device) {
  const auto& vision = store.config().vision();
  if (!vision) throw Error("the model config has no vision_config", store.config().source());
  return load(
      *vision,
      [&](const std::string& name) { return store.contains(name) ? store.get(name) : Tensor(); },
      dtype, device);
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

VisionShard vision_shard(const RowExchange& exchange, int64_t patches, int64_t merge_size,
                         const std::string& where) {
  const int64_t merge = merge_size * merge_size, blocks = patches / merge, ranks = exchange.ranks();
  if (blocks < ranks)
    throw Error(fmt::format("a pack's media give {} merged vision tokens, fewer than the {} "
                            "sequence parallel ranks that split them",
                            blocks, ranks),
                where, "use train.sp_size of at most the merged tokens of every pack's media");
  VisionShard shard;
  shard.exchange = &exchange;
  for (int64_t q = 0; q < ranks; ++q) {
    const int64_t first = blocks * q / ranks, end = blocks * (q + 1) / ranks;
    if (q == exchange.rank()) shard.patch_begin = first * merge;
    shard.patch_counts.push_back((end - first) * merge);
  }
  return shard;
}

std::vector<int64_t> VisionShard::feature_counts(int64_t merge_size) const {
  std::vector<int64_t> counts;
  for (int64_t c : patch_counts) counts.push_back(c / (merge_size * merge_size));
  return counts;
}

VisionOutput vision_forward(const VisionConfig& config, const VisionParams& params,
                            const Tensor& pixel_rows, std::span<const GridThw> grid,
                            VisionContext* context, const VisionShard* shard) {
  check_inputs(config, pixel_rows, grid, shard);
  if (shard && params.device.is_cuda())
    throw Error(
        "vision sequence parallel runs on the CPU only: the exchange of keys and values "
        "between GPUs is not built yet",
        "vision tower", "use train.sp_size = 1 for vision-language data on GPUs");
  if (int64_t(params.blocks.size()) != config.depth)
    throw InternalError(fmt::format("vision params hold {} blocks, config depth is {}",
                                    params.blocks.size(), config.depth));
  return forward_impl(config, params, pixel_rows, grid, context, shard);
}

Tensor vision_backward(const VisionConfig& config, const VisionParams& params,
                       const VisionContext& context, const Tensor& d_pooler, VisionGrads& grads,
                       const VisionBackwardOptions& options) {
  const int64_t n = context.pixels.size(0);
  const int64_t rows = n / (config.spatial_merge_size * config.spatial_merge_size);
  if (context.blocks.size() != params.blocks.size() || !context.merger.x.defined())
    throw InternalError("vision_backward needs the context of a forward run with one");
  GLMTUNE_ASSERT(
      d_pooler.dim() == 2 && d_pooler.size(0) == rows && d_pooler.size(1) == config.out_hidden_size,
      "d_pooler has shape {}, expected [{}, {}]", shape_str(d_pooler.shape()), rows,
      config.out_hidden_size);
  GLMTUNE_ASSERT(
      grads.params.dtype == params.dtype && grads.params.blocks.size() == params.blocks.size(),
      "vision gradient buffers do not mirror the parameters");
  return backward_impl(config, params, context, d_pooler, grads, options);
}

namespace {

// Applies `fn(param, grad)` to every pair of corresponding tensors of two VisionParams.
}  // namespace

VisionGrads VisionGrads::zeros_like(const VisionParams& params) {
  VisionGrads grads;
  grads.params.dtype = params.dtype;
  grads.params.device = params.device;
  grads.params.blocks.resize(params.blocks.size());
  // The GPU accumulates parameter gradients in f32 (ops/cuda/dispatch.h).
  const bool gpu = params.device.is_cuda();
  zip_vision_params(params, grads.params, [&](const std::string&, const Tensor& p, Tensor& g) {
    if (p.defined()) g = Tensor::zeros(p.shape(), gpu ? DType::f32 : p.dtype(), p.device());
  });
  return grads;
}

void VisionGrads::zero() {
  const VisionParams& self = params;
  zip_vision_params(self, params, [](const std::string&, const Tensor&, Tensor& g) {
    if (g.defined()) g.zero_();
  });
}

bool is_projector_param(const std::string& name) {
  return name.starts_with(kPrefix + "downsample.") || name.starts_with(kPrefix + "merger.");
}

std::vector<std::pair<std::string, Tensor>> released_views(const VisionConfig& config,
                                                           const VisionParams& params) {
  std::vector<std::pair<std::string, Tensor>> out;
  const int64_t d = config.hidden_size, o = config.out_hidden_size, m = config.spatial_merge_size;
  zip_vision_params(params, params, [&](const std::string& name, const Tensor& t, const Tensor&) {
    if (!t.defined()) return;
    if (name == "patch_embed.proj.weight")
      out.emplace_back(kPrefix + name, t.view({d, config.in_channels, config.temporal_patch_size,
                                               config.patch_size, config.patch_size}));
    else if (name == "downsample.weight")
      out.emplace_back(kPrefix + name, t.view({o, d, m, m}));
    else
      out.emplace_back(kPrefix + name, t);
  });
  return out;
}

std::vector<std::pair<std::string, Tensor>> VisionGrads::released(const VisionConfig& config,
                                                                  Part part) const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, t] : released_views(config, params)) {
    if (part == (is_projector_param(name) ? Part::tower : Part::projector)) continue;
    out.emplace_back(name, t.clone());
  }
  return out;
}

}  // namespace glmtune::model::vision

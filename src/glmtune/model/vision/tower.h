#pragma once
// The GLM-5.3 vision tower and projector, forward and backward on the CPU (docs/vision.md, "The
// tower" and "Tower backward"):
//
//   pixel rows [N, 3·T·p·p] -> patch embed (the Conv3d is one GEMM per row) -> depth × block
//   { x += proj(attn(rope(qk_norm(qkv(rms(x)))))) per image ; x += swiglu_clamped(rms(x)) }
//   -> post RMSNorm -> 2×2 downsample (Conv2d over each merge block of 4 consecutive rows, one
//   GEMM) -> merger: proj (no bias), LayerNorm, exact-erf GELU, clamped SwiGLU (no biases)
//   -> [N/4, out_hidden_size].
//
// Rows arrive merge-block-major (the processor's order), so positions, attention segments and the
// downsample all follow from grid_thw: image g covers t·h·w consecutive rows, each temporal slice
// of h·w rows attends to itself only (full, non-causal softmax), and its rotary positions are
// (2·bh + mh, 2·bw + mw) for row ((bh·w/2 + bw)·2 + mh)·2 + mw.
//
// Computes in the parameters' dtype: f32 (the reference path; the reference's fp32 forward with
// eager attention) or f64 (tests) on the CPU; on a GPU (parameters loaded onto a CUDA device) with
// the GPU storage policy of the text model: bf16 weights and activations, f32 statistics, rotary
// tables and parameter gradients, every op's CUDA body (ops/vision.h: a flash-attention kernel).
//
// The backward differentiates the same chain in reverse from the gradient of the merger output,
// into every released parameter and optionally the pixel rows. Attention probabilities are not
// kept: the backward recomputes them per query block from the saved Q and K, so memory stays
// linear in the segment length.
//
// Sequence parallel (VisionShard): the pack's patch rows are split over the ranks of a group in
// contiguous ranges of whole merge blocks, so every merged token comes from one rank. Everything
// per row (patch embed, norms, MLPs, the rotation at the row's global position, the downsample
// and merger) runs on the local rows; the attention, the only step that reads other rows, takes
// its queries from the local rows and all-gathers the keys and values of the pack (its segments
// may span ranks), and the backward sums the keys' and values' gradients back to their rows'
// ranks. Parameter gradients are then partial per rank; their sum over the group is the gradient.

#include <array>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/row_exchange.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::model::vision {

// Released names under `model.visual.blocks.{i}.`.
struct VisionBlockParams {
  Tensor norm1, norm2;    // [D] RMSNorm weights
  ops::Linear qkv;        // attn.qkv [3D, D], [3D]; rows Q | K | V, head-major inside each
  Tensor q_norm, k_norm;  // attn.q_norm / k_norm [hd], shared by all heads
  ops::Linear proj;       // attn.proj [D, D], [D]
  ops::Linear gate;       // mlp.gate_proj [I, D], [I]
  ops::Linear up;         // mlp.up_proj [I, D], [I]
  ops::Linear down;       // mlp.down_proj [D, I], [D]
};

// The list of a VisionBlockParams' fields (ops/linear.h), named as under
// `model.visual.blocks.<i>.`.
template <typename A, typename B, typename F>
void zip_vision_block_params(A& a, B& b, F&& f) {
  f("norm1.weight", a.norm1, b.norm1);
  f("norm2.weight", a.norm2, b.norm2);
  ops::zip_linear("attn.qkv", a.qkv, b.qkv, f, /*with_bias=*/true);
  f("attn.q_norm.weight", a.q_norm, b.q_norm);
  f("attn.k_norm.weight", a.k_norm, b.k_norm);
  ops::zip_linear("attn.proj", a.proj, b.proj, f, /*with_bias=*/true);
  ops::zip_linear("mlp.gate_proj", a.gate, b.gate, f, /*with_bias=*/true);
  ops::zip_linear("mlp.up_proj", a.up, b.up, f, /*with_bias=*/true);
  ops::zip_linear("mlp.down_proj", a.down, b.down, f, /*with_bias=*/true);
}

struct VisionParams {
  DType dtype = DType::f32;  // the compute dtype: f32 or f64 on the CPU, bf16 on a GPU
  Device device = Device::cpu();
  ops::Linear patch_embed;  // patch_embed.proj: weight viewed [D, C·T·p·p] (Conv3d as a GEMM)
  std::vector<VisionBlockParams> blocks;
  Tensor post_layernorm;  // [D]
  // downsample.weight [O, D, 2, 2] viewed [O, 4·D] (column c·4 + kh·2 + kw); the GEMM input is
  // each merge block's four rows channel-major; bias [O].
  ops::Linear downsample;
  ops::Linear merger_proj;              // merger.proj [O, O], no bias
  Tensor merger_norm_w, merger_norm_b;  // merger.post_projection_norm [O]
  ops::MlpParams merger;                // merger.{gate,up}_proj [P, O], down_proj [O, P]

  // `get` returns the tensor stored under a released name ("model.visual.patch_embed.proj.weight",
  // ...), in any floating dtype; it is copied into `dtype` on `device` (f32 or f64 on the CPU, bf16
  // on a CUDA device). Shapes are checked against `config`: a missing or mis-shaped tensor is a
  // glmtune::Error naming it.
  static VisionParams load(const VisionConfig& config,
                           const std::function<Tensor(const std::string&)>& get,
                           DType dtype = DType::f32, Device device = Device::cpu());
  // The released shapes of every field under `config` (model::shape_only tensors; the patch
  // embedding and downsample weights in their convolution shapes): what the released layout lists
  // and what load checks.
  static VisionParams shapes(const VisionConfig& config);
  // From a loaded checkpoint (the bf16 released weights are widened exactly).
  static VisionParams from_store(const ParamStore& store, DType dtype = DType::f32,
                                 Device device = Device::cpu());
};

// The list of a VisionParams' fields, named as under `model.visual.` (b's blocks sized like a's).
// The patch embedding and downsample weights are viewed in their GEMM shapes (see above); their
// elements are in the released order.
template <typename A, typename B, typename F>
void zip_vision_params(A& a, B& b, F&& f) {
  ops::zip_linear("patch_embed.proj", a.patch_embed, b.patch_embed, f, /*with_bias=*/true);
  for (size_t l = 0; l < a.blocks.size(); ++l)
    zip_vision_block_params(a.blocks[l], b.blocks[l],
                            ops::Prefixed<F>{f, "blocks." + std::to_string(l) + "."});
  f("post_layernorm.weight", a.post_layernorm, b.post_layernorm);
  ops::zip_linear("downsample", a.downsample, b.downsample, f, /*with_bias=*/true);
  ops::zip_linear("merger.proj", a.merger_proj, b.merger_proj, f);
  f("merger.post_projection_norm.weight", a.merger_norm_w, b.merger_norm_w);
  f("merger.post_projection_norm.bias", a.merger_norm_b, b.merger_norm_b);
  ops::zip_mlp_params(a.merger, b.merger, ops::Prefixed<F>{f, "merger."});
}

using GridThw = std::array<int64_t, 3>;

// Reads an i64 (or i32) [G, 3] tensor of (t, h, w) rows.
std::vector<GridThw> grid_from_tensor(const Tensor& grid_thw);

// Rotary positions (h_pos, w_pos) per row, merge-block-major, every temporal slice repeating its
// image's positions: i64 [N, 2].
Tensor vision_position_ids(std::span<const GridThw> grid, int64_t merge_size);
// Attention segment boundaries: 0, then the running sum of h·w repeated t times per grid row.
std::vector<int64_t> vision_cu_seqlens(std::span<const GridThw> grid);

// This rank's part of a pack's tower under sequence parallelism.
struct VisionShard {
  const RowExchange* exchange = nullptr;
  std::vector<int64_t> patch_counts;  // patch rows of each rank, whole merge blocks each
  int64_t patch_begin = 0;            // the pack's first patch row held here

  int64_t patches() const { return patch_counts[size_t(exchange->rank())]; }
  // Merged tokens (features) of each rank: patch_counts / merge².
  std::vector<int64_t> feature_counts(int64_t merge_size) const;
};

// Rank r of `exchange` takes merge blocks [r·B/S, (r+1)·B/S) of the B = patches / merge² blocks
// of a pack. glmtune::Error (naming `where`) when B < S: a rank would hold no patch.
VisionShard vision_shard(const RowExchange& exchange, int64_t patches, int64_t merge_size,
                         const std::string& where);

struct VisionOutput {
  Tensor last_hidden_state;  // [N/4, O] the downsample output
  Tensor pooler_output;      // [N/4, O] the merger output: what replaces the <|image|> embeddings
};

// What one block's forward keeps for the backward (all [N, ·] in the compute dtype).
struct VisionBlockContext {
  Tensor input;           // [N, D] block input
  Tensor normed1;         // [N, D] norm1 output (the qkv input)
  Tensor rstd1;           // [N]
  Tensor qkv;             // [N, 3D] before the q/k norms
  Tensor q_rstd, k_rstd;  // [N·H] of the q/k norms
  Tensor q, k;            // [N·H, hd] after norm and rotation (the attention operands)
  Tensor attn;            // [N, D] attention output before proj
  Tensor attn_lse;        // [N, H] f32 log-sum-exp of the attention rows (read by the GPU backward)
  Tensor mid;             // [N, D] after the attention residual
  Tensor normed2;         // [N, D] norm2 output (the MLP input)
  Tensor rstd2;           // [N]
  Tensor gate, up;        // [N, I] MLP projections before the clamps
  Tensor act;             // [N, I] silu(min(gate)) ⊙ clamp(up), the down_proj input
  Tensor k_all, v_all;    // sharded: [pack rows, D] keys and values of every rank
};

// Everything vision_backward needs from one forward.
struct VisionContext {
  // Set before the forward: each block keeps its input only and the backward reruns it (about a
  // third more tower FLOPs; the tower's activations shrink to one [N, D] tensor a block).
  bool recompute_blocks = false;
  std::vector<GridThw> grid;
  VisionShard shard;  // exchange null: the whole pack here
  Tensor pixels;      // [N, row] in the compute dtype (the patch-embed input)
  std::vector<VisionBlockContext> blocks;
  Tensor final_hidden;  // [N, D] last block output (the post norm input)
  Tensor post_rstd;     // [N]
  Tensor merged;        // [N/4, 4D] post norm output, each merge block channel-major (the
                        // downsample input)
  Tensor downsampled;   // [N/4, O] last_hidden_state (the merger proj input)
  Tensor projected;     // [N/4, O] merger proj output (the LayerNorm input)
  Tensor ln_mean, ln_rstd;
  Tensor ln_out;           // [N/4, O] LayerNorm output (the GELU input)
  ops::MlpContext merger;  // the clamped SwiGLU (its input is the GELU output)
};

// pixel_rows [N, C·T·p·p] (any floating dtype, converted to params.dtype); grid rows (t, h, w) with
// h and w multiples of the merge size and Σ t·h·w = N. Invalid shapes are glmtune::Errors. With
// `context`, the intermediates of the backward are kept there. With `shard`, pixel_rows are this
// rank's shard.patches() rows of the pack's N = Σ shard.patch_counts (grid: the whole pack's), the
// outputs are this rank's merged tokens, and the call is collective over shard.exchange.
VisionOutput vision_forward(const VisionConfig& config, const VisionParams& params,
                            const Tensor& pixel_rows, std::span<const GridThw> grid,
                            VisionContext* context = nullptr, const VisionShard* shard = nullptr);

// ---- Backward ---------------------------------------------------------------------------------

// (released name, the tensor viewed in its released shape) for every defined tensor of `params`:
// views of the same storage, so that writing through one changes the parameter (an optimizer
// that keeps the weights on the device updates them so).
std::vector<std::pair<std::string, Tensor>> released_views(const VisionConfig& config,
                                                           const VisionParams& params);

// Gradient buffers mirroring VisionParams (the same GEMM shapes: patch embed [D, row], downsample
// [O, 4D]), in the compute dtype on the CPU, f32 on a GPU. Backward passes add into them.
struct VisionGrads {
  VisionParams params;  // every tensor a gradient buffer; `dtype` the compute dtype

  static VisionGrads zeros_like(const VisionParams& params);
  void zero();
  // (released name, gradient in the released shape) for every parameter of `part`: the tower
  // (patch_embed, blocks, post_layernorm), the projector (downsample, merger), or both. The
  // tensors are fresh copies in the released layouts (Conv3d / Conv2d weights un-flattened).
  enum class Part { tower, projector, all };
  std::vector<std::pair<std::string, Tensor>> released(const VisionConfig& config,
                                                       Part part = Part::all) const;
};

// Which parts are differentiated. A frozen part gets no parameter gradient; the projector is still
// back-propagated through when the tower trains.
struct VisionBackwardOptions {
  bool train_tower = true;      // patch_embed, blocks.*, post_layernorm
  bool train_projector = true;  // downsample, merger.*
  bool pixel_grad = false;      // also return d pixel rows
};

// Whether a released parameter name (`model.visual.…`) belongs to the projector (downsample and
// merger) rather than the tower.
bool is_projector_param(const std::string& name);

// Back-propagates d_pooler [N/4, O] (the gradient of pooler_output) through the forward recorded
// in `context`, adding parameter gradients into `grads` as `options` asks. After a sharded forward
// d_pooler holds this rank's merged tokens, the gradients added are this rank's partial sums, and
// the call is collective over the shard's exchange (when the tower trains). Returns the gradient of
// the pixel rows [N, row] with options.pixel_grad, else an undefined tensor.
Tensor vision_backward(const VisionConfig& config, const VisionParams& params,
                       const VisionContext& context, const Tensor& d_pooler, VisionGrads& grads,
                       const VisionBackwardOptions& options = {});

}  // namespace glmtune::model::vision

#pragma once
// The GLM-5.3 vision tower and projector, forward on the CPU (spec vision-and-media §3):
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
// eager attention) or f64 (tests). The bf16 roundings of the released bf16 run are not modelled.

#include <array>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/param_store.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::model::vision {

// Released names under `model.visual.blocks.{i}.`.
struct VisionBlockParams {
  Tensor norm1, norm2;    // [D] RMSNorm weights
  Tensor qkv_w, qkv_b;    // attn.qkv [3D, D], [3D]; rows Q | K | V, head-major inside each
  Tensor q_norm, k_norm;  // attn.q_norm / k_norm [hd], shared by all heads
  Tensor proj_w, proj_b;  // attn.proj [D, D], [D]
  Tensor gate_w, gate_b;  // mlp.gate_proj [I, D], [I]
  Tensor up_w, up_b;      // mlp.up_proj [I, D], [I]
  Tensor down_w, down_b;  // mlp.down_proj [D, I], [D]
};

struct VisionParams {
  DType dtype = DType::f32;
  Tensor patch_embed_w;  // patch_embed.proj.weight viewed [D, C·T·p·p] (Conv3d as a GEMM)
  Tensor patch_embed_b;  // [D]
  std::vector<VisionBlockParams> blocks;
  Tensor post_layernorm;  // [D]
  // downsample.weight [O, D, 2, 2] rearranged to [O, 4·D] with column k·D + c = W[o, c, kh, kw],
  // k = kh·2 + kw: the merge block's four rows side by side form the GEMM input.
  Tensor downsample_w;
  Tensor downsample_b;                  // [O]
  Tensor merger_proj;                   // merger.proj.weight [O, O]
  Tensor merger_norm_w, merger_norm_b;  // merger.post_projection_norm [O]
  Tensor merger_gate, merger_up;        // merger.gate_proj / up_proj [P, O]
  Tensor merger_down;                   // merger.down_proj [O, P]

  // `get` returns the tensor stored under a released name ("model.visual.patch_embed.proj.weight",
  // ...), in any floating dtype; it is copied into `dtype` (f32 or f64). Shapes are checked against
  // `config`: a missing or mis-shaped tensor is a glmtune::Error naming it.
  static VisionParams load(const VisionConfig& config,
                           const std::function<Tensor(const std::string&)>& get,
                           DType dtype = DType::f32);
  // From a loaded checkpoint (the bf16 released weights are widened exactly).
  static VisionParams from_store(const ParamStore& store, DType dtype = DType::f32);
};

using GridThw = std::array<int64_t, 3>;

// Reads an i64 (or i32) [G, 3] tensor of (t, h, w) rows.
std::vector<GridThw> grid_from_tensor(const Tensor& grid_thw);

// Rotary positions (h_pos, w_pos) per row, merge-block-major, every temporal slice repeating its
// image's positions: i64 [N, 2].
Tensor vision_position_ids(std::span<const GridThw> grid, int64_t merge_size);
// Attention segment boundaries: 0, then the running sum of h·w repeated t times per grid row.
std::vector<int64_t> vision_cu_seqlens(std::span<const GridThw> grid);

struct VisionOutput {
  Tensor last_hidden_state;  // [N/4, O] the downsample output
  Tensor pooler_output;      // [N/4, O] the merger output: what replaces the <|image|> embeddings
};

// pixel_rows [N, C·T·p·p] (any floating dtype, converted to params.dtype); grid rows (t, h, w) with
// h and w multiples of the merge size and Σ t·h·w = N. Invalid shapes are glmtune::Errors.
VisionOutput vision_forward(const VisionConfig& config, const VisionParams& params,
                            const Tensor& pixel_rows, std::span<const GridThw> grid);

}  // namespace glmtune::model::vision

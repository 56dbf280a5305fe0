#pragma once
// Block-scaled FP8 (float8 e4m3fn): the quantisation of tile-wise FP8 training and of the released
// FP8 weights, as a CPU reference the GPU quantisers are held to bit for bit.
//
// A [rows, cols] tensor is cut into blocks of br × bc (partial blocks at the bottom and right
// edges included). Per block, with a = max |x| over the block:
//
//   scale = f32( max(a, 1e-12) / 448 )            the quotient in double, rounded once
//   q     = e4m3( clamp(f32(x / scale), −448, 448) )   f32 division, then nearest-even e4m3
//   x̂     = f32( e4m3_value(q) · scale )          exact product rounded once (the f32 multiply)
//
// which is the reference trainer's tile-wise rule (amax in double, clamped at 1e-12, divided by
// e4m3's largest finite value 448; saturating cast). Activations use 1 × 128 tiles (per row, per
// 128 columns of the reduced dimension), weights 128 × 128 blocks (the released checkpoint's
// layout, whose `weight_scale_inv` is this `scale`), and a weight gradient's operands 128 × 1
// tiles (per column, per 128 rows: the reduced dimension of dW = dyᵀ x is the token one).
// Non-finite inputs follow the same rule: a NaN makes its block's scale and values NaN; an
// infinity makes the scale infinite, its own value NaN and the block's finite values 0.

#include <cstdint>

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

inline constexpr double kFp8E4m3Max = 448.0;

struct Fp8Blocks {
  Tensor values;  // fp8e4m3 [rows, cols]
  Tensor scales;  // f32 [ceil(rows / block_rows), ceil(cols / block_cols)]
  int64_t block_rows = 0, block_cols = 0;
};

// x: a [rows, cols] tensor in f32, bf16 or f64 (f64 is rounded to f32 first). On a CUDA device
// (bf16 or f32; blocks 1 x 128, 128 x 128 or 128 x 1) the result has the same codes and scales,
// laid out for the FP8 GEMMs of ops/cuda/fp8.h.
Fp8Blocks quantize_fp8_blocks(const Tensor& x, int64_t block_rows, int64_t block_cols);

// The activation tiles of an FP8 GEMM's input (1 × 128) and the weight blocks (128 × 128).
inline Fp8Blocks quantize_fp8_tiles(const Tensor& x) { return quantize_fp8_blocks(x, 1, 128); }
inline Fp8Blocks quantize_fp8_weight(const Tensor& w) { return quantize_fp8_blocks(w, 128, 128); }

// x̂ in f32, or in bf16 (the exact product rounded once to bf16, as the released checkpoint is
// dequantised: io/fp8.h).
Tensor dequantize_fp8_blocks(const Fp8Blocks& q, DType out = DType::f32);

// Released FP8 weights stacked as pieces of one tensor (the fused experts' gate_e, up_e, …):
// `codes` fp8e4m3 [P · piece_rows, cols], `scales` f32 [P, ceil(piece_rows / 128), ceil(cols /
// 128)] (each piece's 128 × 128 weight_scale_inv). Returns a contiguous tensor of `shape` (the
// codes' element count) in `out` (bf16, or f32 / f64 holding the bf16 values): each piece's
// io::dequantize_fp8_block, bit for bit, on the codes' device.
Tensor dequantize_fp8_pieces(const Tensor& codes, const Tensor& scales, int64_t piece_rows,
                             const Shape& shape, DType out);

// ---- The weights' FP8 form: quantised once, or the released codes themselves ----
// The FP8 GEMMs below read a weight as 128 × 128 blocks (fp8_weight_blocks). Where those blocks
// come from:
//
// - A weight pinned with pin_fp8_weight (a frozen weight the checkpoint stores in FP8): its
//   released codes and weight_scale_inv, for as long as the weight's storage lives, never
//   quantised. Quantising its dequantised (bf16) values again gives back the codes and scale only
//   for a checkpoint quantised by this rule from bf16 values; for scales of another rule it would
//   round a second time.
// - Inside an Fp8WeightReuse scope: the blocks the weight view's first FP8 GEMM of the scope made.
//   A training step opens one around its forward and backward, so that the recompute and the
//   input gradient read the codes the forward made instead of quantising the weight three times;
//   it closes before the optimizer changes the weights. Nothing may write a weight inside a scope.
// - Otherwise: quantize_fp8_weight, afresh in each call.
//
// A weight view is told apart by its storage (held weakly: a freed storage drops its entries),
// offset, shape, strides and dtype, so each expert's slice of the fused experts is a weight of
// its own. The blocks are laid out for the weight's device (on a GPU: ops/cuda/fp8.h's layout).

class Fp8WeightReuse {
 public:
  Fp8WeightReuse();
  ~Fp8WeightReuse();  // the last open scope to close drops the blocks made inside
  Fp8WeightReuse(const Fp8WeightReuse&) = delete;
  Fp8WeightReuse& operator=(const Fp8WeightReuse&) = delete;
};

// The released FP8 form of a weight: `codes` fp8e4m3 [rows, cols] (contiguous rows) and its
// weight_scale_inv `scales` f32 [ceil(rows / 128), ceil(cols / 128)], on one device, as that
// device's FP8 GEMMs read 128 × 128 blocks. The codes are shared, not copied (on a GPU the scales
// are copied into the padded layout of ops/cuda/fp8.h).
Fp8Blocks fp8_weight_from_codes(const Tensor& codes, const Tensor& scales);

// Makes `blocks` (from fp8_weight_from_codes, on the weight's device) the FP8 form of the 2-D
// weight view `weight`, whose values must be their dequantisation.
void pin_fp8_weight(const Tensor& weight, Fp8Blocks blocks);

// The 128 × 128 blocks the FP8 GEMMs use for the 2-D `weight`: pinned, made earlier in the open
// scope, or quantised now (and kept while a scope is open).
Fp8Blocks fp8_weight_blocks(const Tensor& weight);

// Entries held (pinned ones whose storage lives, and the open scope's): for tests and logs.
struct Fp8WeightCounts {
  int64_t pinned = 0, reused = 0;
};
Fp8WeightCounts fp8_weight_counts();

// ---- An input several FP8 GEMMs read: quantised once ----
// Inside an Fp8InputShare naming x, the FP8 GEMMs whose input is x (the same view: storage,
// offset, shape, strides, dtype) share its quantisation: its 1 × 128 tiles (the forward's
// operand) are made by the first forward that reads it, its 128 × 1 tiles (the weight gradient's)
// by the first weight gradient. A composite whose projections read one input opens one around
// them: KDA's six projections of x, the MLP's gate and up, MLA's q_a and kv_a. The codes are the
// ones each GEMM would have made (the quantisation is a function of x), held until the scope
// closes; x must not be written inside it. Scopes nest; each names its own input.

class Fp8InputShare {
 public:
  explicit Fp8InputShare(const Tensor& x);
  ~Fp8InputShare();
  Fp8InputShare(const Fp8InputShare&) = delete;
  Fp8InputShare& operator=(const Fp8InputShare&) = delete;
};

// The 1 × 128 or 128 × 1 tiles of x [..., n] viewed as [rows, n]: the open share's when one names
// x, else quantised now (quantize_fp8_blocks).
Fp8Blocks fp8_input_tiles(const Tensor& x, int64_t block_rows, int64_t block_cols);

// ---- The GEMMs of tile-wise FP8 training (train.fp8 = "tilewise") ----
// A projection marked Linear::fp8 (ops/linear.h) runs its three products on block-scaled FP8
// operands, as the reference trainer's tile-wise recipe does. With Q(a; br × bc) the quantised and
// dequantised a (quantize_fp8_blocks, then its x̂):
//
//   forward       y   = Q(x; 1 × 128) · Q(W; 128 × 128)ᵀ
//   input grad    dx  = Q(dy; 1 × 128) · Q(W; 128 × 128)
//   weight grad   dW += Q(dy; 128 × 1)ᵀ · Q(x; 128 × 1)
//
// each with f32 accumulation: on the CPU an f32 (or f64) GEMM of the dequantised operands, on a
// GPU cuBLASLt's block-scaled e4m3 GEMMs (ops/cuda/fp8.h), which compute the same products up to
// the order of the f32 sums. x is [..., in] (its leading dimensions are the tokens, over which
// the weight gradient's 128 × 1 tiles run, from the first row), W [out, in]; the master weight
// stays in its own dtype, and Q(W) is fp8_weight_blocks(W) (pinned codes are used as they are). The
// weight gradient is the straight-through one (quantisation counts as the identity), as in the
// reference trainer. On a GPU `in` and `out` must be multiples of 16 (cuBLASLt's FP8 alignment).

// y [..., out] in x's dtype.
Tensor linear_fp8(const Tensor& x, const Tensor& weight);

// The backward of linear_fp8 for dy [..., out]: dW accumulates into *grad_weight as
// linear_backward's does (null, or a frozen weight: skipped); dx is added to *dx_sum (null: not
// computed; undefined: it becomes dx, in gradient_sum_dtype, ops/dispatch.h).
void linear_fp8_backward_add(Tensor* dx_sum, const Tensor& dy, const Tensor& x,
                             const Tensor& weight, Tensor* grad_weight);

// The same backward where dx is this projection's alone: dW as above, dx [..., in] returned in x's
// dtype, the f32 product rounded once. On a GPU the FP8 GEMM writes it in that dtype directly, with
// no f32 copy and no conversion pass.
Tensor linear_fp8_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                           Tensor* grad_weight);

}  // namespace glmtune::ops

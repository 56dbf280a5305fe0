#pragma once
// Block-scaled FP8 on the GPU: the quantisers of ops/fp8.h (bit for bit the CPU reference's codes
// and scales) and the e4m3 GEMMs of FP8 training through cuBLASLt's block scaling (Hopper, cuBLAS
// 12.9 or later): f32 accumulation inside the GEMM, bf16 or f32 results. docs/fp8.md has the
// layouts, the error bound the parity test holds and what cuBLASLt does and does not take.
//
// Logical contract, physical layout. A quantiser here returns an ops::Fp8Blocks that is equal,
// element for element, to ops::quantize_fp8_blocks of the same input on the CPU (values [rows,
// cols] fp8e4m3, scales [ceil(rows / br), ceil(cols / bc)] f32): copy it to the CPU and compare.
// Its tensors are strided views whose memory is laid out as cuBLASLt reads it:
//
//   1 × 128 (activations, dy)  values row-major [pad4(rows), cols], code 0 in the padding rows;
//                              scales of tile (r, b) at b · pad4(rows) + r: the rows (the GEMM's
//                              outer dimension) fastest, each 128-column block a padded column.
//   128 × 128 (weights)        values row-major [rows, cols];
//                              scales of block (i, j) at i · pad4(ceil(cols / 128)) + j.
//   128 × 1 (wgrad operands)   values stored transposed, [cols, pad16(rows)] row-major (the value
//                              of (r, c) at c · pad16(rows) + r; the padding rows hold code 0);
//                              scales of tile (b, c) at b · pad4(cols) + c.
//
// pad4 / pad16 round up to a multiple of 4 / 16; padding scales hold 0. cuBLASLt (13.1, sm_90) has
// VEC128 algorithms only for an outer dimension that is a multiple of 4 and reads the scales with
// that dimension as their leading one, so the 1 × 128 GEMMs run on pad4(rows) rows: the zero
// padding rows are part of the buffer. The 128 × 1 form is the
// transposed matrix quantised in 1 × 128 tiles along the token dimension, which is what the weight
// gradient's GEMM reads (cuBLASLt's FP8 GEMMs on Hopper take only the "TN" form, both operands
// contiguous along the reduced dimension).
//
// Every call is asynchronous on `stream` (the legacy default stream when null); tensors live on one
// CUDA device. Algorithms come from the cuBLASLt heuristic, cached per problem, so reruns are
// bit-identical. A problem the heuristic has no algorithm for throws glmtune::Error naming the
// shape, the scale modes and the cuBLAS status.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "glmtune/ops/fp8.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// ---- quantisers ------------------------------------------------------------------------------

// x: a CUDA [rows, cols] tensor in bf16 or f32 with unit inner stride. Blocks (1, 128), (128, 128)
// or (128, 1); other blocks throw (the CPU op takes any). Non-finite inputs follow ops/fp8.h; the
// sign of a NaN code or scale is not part of the contract (x86 and the GPU make different ones).
ops::Fp8Blocks quantize_fp8_blocks(const Tensor& x, int64_t block_rows, int64_t block_cols,
                                   cudaStream_t stream = nullptr);

// The weight's transpose in 128 × 128 blocks, from the quantised weight (a byte transpose: block
// quantisation commutes with transposition, so this equals quantising wᵀ). The input-gradient GEMM
// reads it.
ops::Fp8Blocks transpose_fp8_weight(const ops::Fp8Blocks& w, cudaStream_t stream = nullptr);

// Whether `q` is on a CUDA device in the layout above (the GEMMs' precondition).
bool is_fp8_gemm_layout(const ops::Fp8Blocks& q);

// A quantised tensor from anywhere (a CPU reference, a released checkpoint's fp8 weight and its
// weight_scale_inv) laid out on `device` as above. Blocks (1, 128), (128, 128) or (128, 1).
ops::Fp8Blocks fp8_blocks_to_device(const ops::Fp8Blocks& q, Device device);

// ---- released FP8 weights -------------------------------------------------------------------

// A released weight's codes fp8e4m3 [rows, cols] (contiguous, on a CUDA device) and its
// weight_scale_inv f32 [ceil(rows / 128), ceil(cols / 128)] as 128 × 128 GEMM operand blocks: the
// codes shared (the values layout is theirs), the scales copied into the padded layout.
ops::Fp8Blocks fp8_weight_from_codes(const Tensor& codes, const Tensor& scales);

// Weights as the released checkpoint stores them, stacked: `codes` fp8e4m3 [P·r, c] (any shape of
// that many rows of c) on a CUDA device, P pieces of `piece_rows` rows, each with its own 128 × 128
// block grid: `scales` f32 [P, ceil(r / 128), ceil(c / 128)] (each piece's weight_scale_inv; the
// fused experts stack gate_e, up_e, … in the fused tensor's row order). Writes into `out`
// (contiguous, codes' element count, bf16 or f32) each piece's io::dequantize_fp8_block bit for
// bit: the exact product rounded once to bf16 (widened to f32 for an f32 `out`).
void dequantize_fp8_pieces(Tensor& out, const Tensor& codes, const Tensor& scales,
                           int64_t piece_rows, cudaStream_t stream = nullptr);

// ---- dense GEMMs -----------------------------------------------------------------------------
// Requirements (checked, with a message): operands in the layout above, N and K multiples of 16
// (cuBLASLt's FP8 alignment: 16-byte rows), y / dx / dw contiguous bf16 or f32. The token count M
// is free; where it is not a multiple of 4 the product goes through a staging output of pad4(M)
// rows (one extra copy of the output, two when accumulating), and only y's own rows are written.
// With `accumulate` the product is added to what the output holds (beta = 1).

// y[M, N] = x[M, K] · w[N, K]ᵀ: x in 1 × 128 tiles (scale mode VEC128_32F), w in 128 × 128 blocks
// (BLK128x128_32F).
void fp8_linear_out(Tensor& y, const ops::Fp8Blocks& x, const ops::Fp8Blocks& w,
                    bool accumulate = false, cudaStream_t stream = nullptr);
Tensor fp8_linear(const ops::Fp8Blocks& x, const ops::Fp8Blocks& w, DType out = DType::bf16,
                  cudaStream_t stream = nullptr);

// dx[M, K] = dy[M, N] · w[N, K]: dy in 1 × 128 tiles along N, w_t = transpose_fp8_weight(w) (the
// same 128 × 128 blocks, stored [K, N]). This is fp8_linear of dy and w_t.
void fp8_linear_backward_input_out(Tensor& dx, const ops::Fp8Blocks& dy, const ops::Fp8Blocks& w_t,
                                   bool accumulate = false, cudaStream_t stream = nullptr);

// dw[N, K] (+)= dy[T, N]ᵀ · x[T, K]: dy and x both in 128 × 1 tiles (per column, per 128 tokens;
// scale mode VEC128_32F on both operands), the reduction over the tokens' zero padding included.
void fp8_linear_backward_weight(Tensor& dw, const ops::Fp8Blocks& dy, const ops::Fp8Blocks& x,
                                bool accumulate = true, cudaStream_t stream = nullptr);

// ---- grouped (per expert) --------------------------------------------------------------------
// The shapes of ops/cuda/grouped_gemm.h: group g owns rows offsets[g] .. offsets[g + 1] − 1 of the
// row operands (host offsets [G + 1]). This first version runs one dense FP8 GEMM per non-empty
// group (cuBLAS 13.1 has no grouped FP8 call for Hopper); each group's operands are quantised on
// their own, anchored at the group's first row, so a tile never spans two experts.

// x [T, K] bf16 / f32 in 1 × 128 tiles (block_rows 1) or 128 × 1 tiles (block_rows 128), one
// Fp8Blocks per group (an empty group gets an empty one), each what quantize_fp8_blocks of the
// group's rows gives. Up to 320 groups run as one kernel writing one buffer of codes and one of
// scales, the groups' Fp8Blocks being views of them; more run one quantisation per group.
std::vector<ops::Fp8Blocks> quantize_fp8_grouped(const Tensor& x,
                                                 const std::vector<int64_t>& offsets,
                                                 int64_t block_rows, int64_t block_cols,
                                                 cudaStream_t stream = nullptr);
// w [G, N, K] bf16 / f32 in 128 × 128 blocks per expert.
std::vector<ops::Fp8Blocks> quantize_fp8_weight_grouped(const Tensor& w,
                                                        cudaStream_t stream = nullptr);

// y[rows_g, N] = x_g · w_gᵀ.
void fp8_grouped_linear(Tensor& y, const std::vector<ops::Fp8Blocks>& x,
                        const std::vector<ops::Fp8Blocks>& w, const std::vector<int64_t>& offsets,
                        cudaStream_t stream = nullptr);
// dx[rows_g, K] = dy_g · w_g, with w the forward's blocks: each group's weight is transposed
// (transpose_fp8_weight) just before its product and dropped after, so one group's copy is alive
// at a time, not a second copy of every expert's codes (4.5 GiB for a released MoE layer's
// gate_up_proj).
void fp8_grouped_linear_backward_input(Tensor& dx, const std::vector<ops::Fp8Blocks>& dy,
                                       const std::vector<ops::Fp8Blocks>& w,
                                       const std::vector<int64_t>& offsets,
                                       cudaStream_t stream = nullptr);
// dw[g] += dy_gᵀ · x_g, dw [G, N, K] f32 or bf16; groups without rows are left alone.
void fp8_grouped_linear_backward_weight(Tensor& dw, const std::vector<ops::Fp8Blocks>& dy,
                                        const std::vector<ops::Fp8Blocks>& x,
                                        const std::vector<int64_t>& offsets,
                                        cudaStream_t stream = nullptr);

// ---- grouped, offsets on the device (Hopper) --------------------------------------------------
// One launch for every group, the offsets read by the kernel (int32 [G + 1] on the device,
// nondecreasing, as ops/cuda/grouped_gemm.h's device-offset kernels take them), so the host never
// waits for them (ops/cuda/grouped_fp8_sm90.cuh). The operands of the forward and dX: x (or dy) is
// the whole permuted buffer quantised at once, quantize_fp8_blocks(x, 1, 128) (a 1 × 128 tile lies
// within a row, so each group's tiles are those of its rows alone); w_stack is every group's
// [N, K] weight stacked as one [G · N, K] matrix in 128 × 128 blocks (fp8_weight_blocks of the
// fused [E, N, K] viewed as [E · N, K]: each expert's own codes and scales when N is a multiple of
// 128, which is required).
//
// f32 accumulation of each 128-wide k block, scaled and added in f32; bf16 or f32 output. The
// order of the sums is fixed per output tile: reruns are bit-identical.

// Whether these operands can take the kernels: an sm_90a build on a 9.x device, x in 1 × 128 tiles
// and w_stack in 128 × 128 blocks in the layouts above (16-byte aligned), N = out's columns a
// multiple of 128 and w_stack [groups · N, K], K a multiple of 16, 1 to 1024 groups, `out` a
// contiguous bf16 or f32 [rows of x, N].
bool fp8_grouped_device_offsets_fit(const ops::Fp8Blocks& x, const ops::Fp8Blocks& w_stack,
                                    const Tensor& out, int64_t groups);
// Whether a call with these sizes could: the device and the sizes alone (before quantising).
bool fp8_grouped_device_offsets_possible(int device, int64_t groups, int64_t n, int64_t k);

// y[rows_g, N] (+)= x_g · w_gᵀ. Rows past offsets[G] are left alone.
void fp8_grouped_linear(Tensor& y, const ops::Fp8Blocks& x, const ops::Fp8Blocks& w_stack,
                        const Tensor& offsets, cudaStream_t stream = nullptr,
                        bool accumulate = false);

// dx[rows_g, K] = dy_g · w_g, dy in 1 × 128 tiles along N, N and K multiples of 128. The FP8 MMA
// reads both operands along the reduced dimension, so the groups' weights are transposed
// (transpose_fp8_weight_stack) in chunks of at most `chunk_bytes` of codes (at least one group),
// one launch each, each chunk's copy dropped after it: never a second copy of every expert's codes.
inline constexpr int64_t kFp8TransposeChunkBytes = int64_t(256) << 20;
void fp8_grouped_linear_backward_input(Tensor& dx, const ops::Fp8Blocks& dy,
                                       const ops::Fp8Blocks& w_stack, const Tensor& offsets,
                                       cudaStream_t stream = nullptr,
                                       int64_t chunk_bytes = kFp8TransposeChunkBytes);

// The weight gradient's operands: x [T, cols] (bf16 or f32 rows) in 128 × 1 tiles per group from
// the group's first row (what quantize_fp8_grouped(x, offsets, 128, 1) makes, with the offsets on
// the device), all groups in one transposed matrix: group g's rows are columns 128 · tiles[g] ..
// of `codes` (code 0 past its last row up to its last tile's end), its tile t's scales row
// tiles[g] + t of `scales`. `padded` = 128 · (ceil(T / 128) + G) holds any grouping, so the host
// never reads the offsets; what lies past 128 · tiles[G] is not written.
struct Fp8TokenTiles {
  Tensor codes;        // fp8e4m3 [cols, padded]
  Tensor scales;       // f32 [padded / 128, pad4(cols)] (zero in the padding columns)
  Tensor tiles;        // int32 [G + 1] on the device: cumulative ceil(rows_g / 128)
  int64_t padded = 0;  // a multiple of 128
};
Fp8TokenTiles quantize_fp8_token_tiles(const Tensor& x, const Tensor& offsets,
                                       cudaStream_t stream = nullptr);

// dw[g] += dy_gᵀ · x_g for the groups with rows (the others are left alone), dw [G, N, K] f32 or
// bf16 contiguous, N and K multiples of 128; dy and x from quantize_fp8_token_tiles with the same
// offsets (N = dy's columns, K = x's).
void fp8_grouped_linear_backward_weight(Tensor& dw, const Fp8TokenTiles& dy, const Fp8TokenTiles& x,
                                        const Tensor& offsets, cudaStream_t stream = nullptr);

// Groups first .. first + count − 1 of a stack of [n, K] blocks (each group's n rows), each
// transposed: [count · K, n] in 128 × 128 blocks, the stack of the groups' transposed weights.
// n and K multiples of 128.
ops::Fp8Blocks transpose_fp8_weight_stack(const ops::Fp8Blocks& w_stack, int64_t n, int64_t first,
                                          int64_t count, cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda

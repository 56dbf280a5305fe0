#pragma once
// The launchers of the FP8 quantiser kernels (ops/cuda/fp8.cu), on raw device pointers; the
// tensor-level checks and layouts are in ops/cuda/fp8_cuda.cpp (ops/cuda/fp8.h). Row pitches are
// in elements; `x_bf16` says whether x holds bf16 (else f32). Shapes are validated by the callers.

#include <cuda_runtime.h>

#include <cstdint>

namespace glmtune::cuda::fp8_kernels {

// 1 × 128 tiles: code (r, c) at q[r · ld_q + c], the scale of tile (r, b) at s[b · ld_s + r].
void quantize_tiles(const void* x, bool x_bf16, int64_t rows, int64_t cols, int64_t ld_x,
                    uint8_t* q, int64_t ld_q, float* s, int64_t ld_s, cudaStream_t stream);

// 128 × 128 blocks: code (r, c) at q[r · ld_q + c], the scale of block (i, j) at s[i · ld_s + j].
void quantize_blocks(const void* x, bool x_bf16, int64_t rows, int64_t cols, int64_t ld_x,
                     uint8_t* q, int64_t ld_q, float* s, int64_t ld_s, cudaStream_t stream);

// 128 × 1 tiles, stored transposed: code (r, c) at q[c · ld_q + r], code 0 at the padding rows
// rows .. ld_q − 1 (ld_q a multiple of 16), the scale of tile (b, c) at s[b · ld_s + c].
void quantize_columns(const void* x, bool x_bf16, int64_t rows, int64_t cols, int64_t ld_x,
                      uint8_t* q, int64_t ld_q, float* s, int64_t ld_s, cudaStream_t stream);

// ---- the per-expert quantisations of one permuted buffer, in one launch ----
// Group g owns x's rows rows[g] .. rows[g + 1] − 1 (cumulative, rows[0] = 0). Each group's output
// is the layout one quantize_tiles / quantize_columns call on its rows writes, placed one after
// another in one buffer, so that a group's Fp8Blocks is a view of it.
constexpr int kMaxGroupsPerLaunch = 320;  // the table stays under 4 KB of kernel parameters

struct GroupTable {
  int32_t groups = 0;
  int32_t rows[kMaxGroupsPerLaunch + 1];
  // 1 × 128: cumulative pad4(rows_g); 128 × 1: cumulative pad16(rows_g).
  int32_t padded[kMaxGroupsPerLaunch + 1];
  // 128 × 1: cumulative ceil(rows_g / 128), the 128-row tiles.
  int32_t tiles[kMaxGroupsPerLaunch + 1];
};

// 1 × 128 tiles: group g's codes are rows padded[g] .. padded[g + 1] − 1 of q [padded[G], cols]
// (its rows, then zero rows up to pad4), its scales [ceil(cols / 128), pad4(rows_g)] start at
// s + padded[g] · ceil(cols / 128) (zero for the padding rows).
void quantize_group_tiles(const void* x, bool x_bf16, int64_t cols, int64_t ld_x,
                          const GroupTable& table, uint8_t* q, float* s, cudaStream_t stream);

// 128 × 1 tiles per group, from the group's first row: group g's codes, transposed [cols,
// pad16(rows_g)], start at q + padded[g] · cols (zero in the padding rows); its scales
// [ceil(rows_g / 128), pad4(cols)] at s + tiles[g] · pad4(cols). The scales of the padding columns
// are not written: the caller zeroes s.
void quantize_group_columns(const void* x, bool x_bf16, int64_t cols, int64_t ld_x,
                            const GroupTable& table, uint8_t* q, float* s, cudaStream_t stream);

// 128 × 1 tiles per group with the offsets on the device (int32 [groups + 1] over x's `rows`):
// writes tiles (int32 [groups + 1]) = the 128-row tiles of the groups before g; group g's codes go
// to columns 128 · tiles[g] .. of the transposed q [cols, ld_q] (code 0 past its last row up to
// its last tile's end), the scale of its tile t and column c to s[(tiles[g] + t) · ld_s + c].
// ld_q ≥ 128 · (ceil(rows / 128) + groups), a multiple of 128, holds any grouping of the rows;
// what lies past 128 · tiles[groups] is not written.
void quantize_device_group_columns(const void* x, bool x_bf16, int64_t rows, int64_t cols,
                                   int64_t ld_x, const int32_t* offsets, int groups, int32_t* tiles,
                                   uint8_t* q, int64_t ld_q, float* s, int64_t ld_s,
                                   cudaStream_t stream);

// out[row, col] = round(fp8(codes[row, col]) · scales[piece, r / 128, col / 128]) for rows of
// `piece_rows` stacked pieces (row = piece · piece_rows + r), the exact product rounded once to
// bf16 (widened to f32 with f32_out). codes [rows, cols] and out contiguous.
void dequantize_pieces(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols,
                       int64_t piece_rows, bool f32_out, void* out, cudaStream_t stream);

// out[c · ld_out + r] = in[r · ld_in + c] for a [rows, cols] matrix of bytes or of f32, or for
// `batch` of them, matrix b at in + b · in_step and out + b · out_step. Bytes in whole 4-byte
// words only (every size, pitch and step a multiple of 4, the pointers aligned to it), as the
// FP8 GEMMs' weights are (dimensions multiples of 16).
void transpose_u8(const uint8_t* in, int64_t rows, int64_t cols, int64_t ld_in, uint8_t* out,
                  int64_t ld_out, cudaStream_t stream, int64_t batch = 1, int64_t in_step = 0,
                  int64_t out_step = 0);
void transpose_f32(const float* in, int64_t rows, int64_t cols, int64_t ld_in, float* out,
                   int64_t ld_out, cudaStream_t stream, int64_t batch = 1, int64_t in_step = 0,
                   int64_t out_step = 0);

}  // namespace glmtune::cuda::fp8_kernels

// The FP8 quantiser kernels (ops/cuda/fp8_kernels.h). Each computes exactly the CPU reference's
// arithmetic (ops/cpu/fp8.cpp): the block amax of |x| (a NaN wins), the scale
// f32(max(amax, 1e-12) / 448) with the quotient in double, then f32(x / scale) by a correctly
// rounded f32 division, clamped to ±448 unless NaN, rounded to e4m3 by the shared host/device
// conversion of tensor/dtype.h. The scale is computed in f32 and the division goes through the
// tile's reciprocal where the scale is finite (ops/fp8_quotient.h: the same scales and codes, a
// third of the instructions), and a max is exact in any order, so the codes and scales are the
// CPU's bit for bit.

#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/ops/cuda/fp8_kernels.h"
#include "glmtune/ops/fp8_quotient.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/dtype.h"

namespace glmtune::cuda::fp8_kernels {
namespace {

__device__ __forceinline__ float load_x(const void* x, bool bf16, int64_t i) {
  if (bf16) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(x)[i]) << 16);
  return static_cast<const float*>(x)[i];
}

// max with a NaN winning, as the CPU's amax loop (one instruction from sm_80 on).
__device__ __forceinline__ float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  if (a != a || b != b) return __int_as_float(0x7fc00000);
  return a > b ? a : b;
#endif
}

__device__ __forceinline__ float warp_nan_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A tile's scale, and whether its values may be divided through the reciprocal: a finite scale of
// the rule is at least 1e-12 / 448, so its reciprocal is a normal number (ops/fp8_quotient.h).
struct Divisor {
  float scale, inv;
  bool by_reciprocal;
};

__device__ __forceinline__ Divisor divisor_of(float scale) {
  return {scale, __frcp_rn(scale), isfinite(scale)};
}

__device__ __forceinline__ float divided(float x, const Divisor& d) {
  return d.by_reciprocal ? ops::fp8_quotient(x, d.scale, d.inv) : __fdiv_rn(x, d.scale);
}

// The clamp to ±448 (a NaN kept) before the rounding to e4m3. Ada and Hopper's conversion
// saturates to ±448 itself, which is the same code for every finite value.
__device__ __forceinline__ float clamped(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return v;
#else
  constexpr float kMax = 448.0f;
  return v == v ? (v < -kMax ? -kMax : (kMax < v ? kMax : v)) : v;
#endif
}

// Two clamped values to their codes, lo in the low byte. Ada and Hopper round to e4m3 in one
// instruction (round to nearest even, as tensor/dtype.h; on values within ±448 saturation never
// applies, and a NaN stays a NaN code, whose sign the contract leaves open).
__device__ __forceinline__ uint32_t e4m3_pair(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return uint32_t(f32_to_fp8e4m3(lo)) | uint32_t(f32_to_fp8e4m3(hi)) << 8;
#endif
}

__device__ __forceinline__ uint8_t quantize(float x, const Divisor& d) {
  return uint8_t(e4m3_pair(clamped(divided(x, d)), 0.0f));
}

// The codes of v[0 .. 3], code 0 from index `valid` on, lo in the low byte. The choice between
// reciprocal and division is made once for the four (it is the tile's).
__device__ __forceinline__ uint32_t codes4(const float v[4], int valid, const Divisor& d) {
  float a[4];
  if (d.by_reciprocal) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[j] = ops::fp8_quotient(v[j], d.scale, d.inv);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[j] = __fdiv_rn(v[j], d.scale);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = j < valid ? clamped(a[j]) : 0.0f;
  return e4m3_pair(a[0], a[1]) | e4m3_pair(a[2], a[3]) << 16;
}

// Four consecutive values of row-major x from element i on: with kVec one 8-byte (bf16) or 16-byte
// (f32) load, for which i is a multiple of 4 and x aligned to it; else one load per value, those at
// or past `valid` (the columns left in the row) reading as 0.
template <bool kVec>
__device__ __forceinline__ void load4(const void* x, bool bf16, int64_t i, int64_t valid,
                                      float v[4]) {
  if constexpr (kVec) {
    if (valid <= 0) {
      v[0] = v[1] = v[2] = v[3] = 0.0f;
    } else if (bf16) {
      const uint2 p = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(x) + i);
      v[0] = __uint_as_float(p.x << 16);
      v[1] = __uint_as_float(p.x & 0xffff0000u);
      v[2] = __uint_as_float(p.y << 16);
      v[3] = __uint_as_float(p.y & 0xffff0000u);
    } else {
      const float4 p = *reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
      v[0] = p.x, v[1] = p.y, v[2] = p.z, v[3] = p.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = j < valid ? load_x(x, bf16, i + j) : 0.0f;
  }
}

// The codes of four consecutive values into q[i ..]: one 4-byte store with kVec (i a multiple of 4,
// q aligned to it), else one store per value before `valid`.
template <bool kVec>
__device__ __forceinline__ void store4(uint8_t* q, int64_t i, int64_t valid, const float v[4],
                                       const Divisor& d) {
  if constexpr (kVec) {
    if (valid <= 0) return;
    *reinterpret_cast<uint32_t*>(q + i) = codes4(v, 4, d);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (j < valid) q[i + j] = quantize(v[j], d);
  }
}

// Whether the 1 × 128 and 128 × 128 quantisers may move four values at a time: whole groups of four
// columns, rows that start aligned.
bool vector_ok(const void* x, bool x_bf16, int64_t cols, int64_t ld_x, const uint8_t* q,
               int64_t ld_q) {
  const uintptr_t x_align = x_bf16 ? 8 : 16;
  return cols % 4 == 0 && ld_x % 4 == 0 && ld_q % 4 == 0 &&
         reinterpret_cast<uintptr_t>(x) % x_align == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0;
}

// ---- 1 × 128 tiles: one warp per (row, kRowTiles tiles), four columns per lane -----------------

constexpr int kTileWarps = 8;
// Tiles of a row a warp takes, their loads issued before any is reduced: at one tile a warp, a
// lane had 8 bytes in flight and the loads' latency, not the bandwidth, bound the kernel.
constexpr int kRowTiles = 4;

// One warp's tiles first_tile .. first_tile + kRowTiles − 1 of row x_row (a pointer offset in
// elements; `cols` columns), codes from q_row on. Tile t's scale goes to scale_at[t · ld_s] (by
// lane 0); tiles at or past the row's end are skipped.
template <bool kVec>
__device__ __forceinline__ void quantize_row_tiles(const void* __restrict__ x, bool x_bf16,
                                                   int64_t x_row, int64_t cols, int64_t first_tile,
                                                   uint8_t* __restrict__ q, int64_t q_row,
                                                   float* scale_at, int64_t ld_s, int lane) {
  float v[kRowTiles][4];
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    const int64_t c0 = (first_tile + t) * 128 + lane * 4;
    load4<kVec>(x, x_bf16, x_row + c0, cols - c0, v[t]);
  }
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    const int64_t tile = first_tile + t;
    if (tile * 128 >= cols) break;  // the same for every lane of the warp
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = nan_max(amax, fabsf(v[t][j]));
    amax = warp_nan_max(amax);
    const Divisor d = divisor_of(ops::fp8_scale(amax));
    if (lane == 0) scale_at[tile * ld_s] = d.scale;
    const int64_t c0 = tile * 128 + lane * 4;
    store4<kVec>(q, q_row + c0, cols - c0, v[t], d);
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kTileWarps * 32)
    quantize_tiles_kernel(const void* __restrict__ x, bool x_bf16, int64_t rows, int64_t cols,
                          int64_t ld_x, uint8_t* __restrict__ q, int64_t ld_q,
                          float* __restrict__ s, int64_t ld_s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = int64_t(blockIdx.x) * kTileWarps + warp;
  if (r >= rows) return;
  quantize_row_tiles<kVec>(x, x_bf16, r * ld_x, cols, int64_t(blockIdx.y) * kRowTiles, q, r * ld_q,
                           s + r, ld_s, lane);
}

// ---- 128 × 128 blocks: one block of 256 threads per weight block, 64 values per thread ----------

template <bool kVec>
__global__ void __launch_bounds__(256)
    quantize_blocks_kernel(const void* __restrict__ x, bool x_bf16, int64_t rows, int64_t cols,
                           int64_t ld_x, uint8_t* __restrict__ q, int64_t ld_q,
                           float* __restrict__ s, int64_t ld_s) {
  __shared__ float warp_max[8];
  __shared__ float block_scale;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.y) * 128, c0 = int64_t(blockIdx.x) * 128 + lane * 4;
  float v[16][4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t r = r0 + warp + 8 * i;
    load4<kVec>(x, x_bf16, r * ld_x + c0, r < rows ? cols - c0 : 0, v[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = nan_max(amax, fabsf(v[i][j]));
  }
  amax = warp_nan_max(amax);
  if (lane == 0) warp_max[warp] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_max[0];
    for (int w = 1; w < 8; ++w) m = nan_max(m, warp_max[w]);
    block_scale = ops::fp8_scale(m);
    s[int64_t(blockIdx.y) * ld_s + blockIdx.x] = block_scale;
  }
  __syncthreads();
  const Divisor d = divisor_of(block_scale);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t r = r0 + warp + 8 * i;
    if (r < rows) store4<kVec>(q, r * ld_q + c0, cols - c0, v[i], d);
  }
}

// ---- 128 × 1 tiles, transposed: a block stages 128 rows × 64 columns in shared memory ----------
// Loads run along the columns (x's rows are contiguous), four values a lane and eight rows a thread
// issued together; each column's 128 values are then reduced by four threads (32 rows each) and
// written as 16-byte runs of the transposed output.

constexpr int kColTileCols = 64;

// One block's 128 × 64 tile of a [rows, cols] matrix whose row 0 is element x0 of x: rows r0 ..
// r0 + 127, columns c0 .. c0 + 63. Its 64 scales go to s_row[c], its codes to the transposed
// q[c · ld_q + r] (code 0 from `rows` up to ld_q, a multiple of 16 like the start of q).
template <bool kVec>
__device__ __forceinline__ void quantize_column_tile(const void* __restrict__ x, bool x_bf16,
                                                     int64_t x0, int64_t rows, int64_t cols,
                                                     int64_t ld_x, int64_t r0, int64_t c0,
                                                     uint8_t* __restrict__ q, int64_t ld_q,
                                                     float* __restrict__ s_row) {
  // Row r's column c sits at (c + 8 · (r / 32)) mod 64 of its padded row, so that a warp's reads
  // below (eight columns, four threads each at rows 16 apart) fall in 32 distinct banks.
  __shared__ float tile[128][kColTileCols + 1];
  auto at = [&](int r, int c) -> float& {
    return tile[r][(c + 8 * (r >> 5)) & (kColTileCols - 1)];
  };
  {
    const int row = threadIdx.x >> 4, quad = threadIdx.x & 15;
    float v[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t r = r0 + row + 16 * i, c = c0 + 4 * quad;
      load4<kVec>(x, x_bf16, x0 + r * ld_x + c, r < rows ? cols - c : 0, v[i]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) at(row + 16 * i, 4 * quad + j) = v[i][j];
  }
  __syncthreads();
  // Four consecutive lanes per column, lane `part` taking rows 16·part .. + 15 and 64 + 16·part ..
  // + 15: each of the two stores below writes 64 contiguous bytes of the column's codes per four
  // lanes.
  const int col = threadIdx.x >> 2, part = threadIdx.x & 3;
  float amax = 0.0f;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = nan_max(amax, fabsf(at(64 * h + 16 * part + i, col)));
  amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const int64_t c = c0 + col;
  if (c >= cols) return;
  const Divisor d = divisor_of(ops::fp8_scale(amax));
  if (part == 0) s_row[c] = d.scale;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int first = 64 * h + 16 * part;
    if (r0 + first >= ld_q) break;  // past the padded row count: nothing to store
    uint32_t out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float a[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) a[k] = at(first + 4 * w + k, col);
      // Rows from `rows` on are padding: code 0 whatever the scale.
      const int64_t valid = rows - (r0 + first + 4 * w);
      out[w] = codes4(a, valid < 4 ? int(valid) : 4, d);
    }
    // ld_q and r0 + first are multiples of 16, so the run is one aligned 16-byte store.
    *reinterpret_cast<uint4*>(q + c * ld_q + r0 + first) =
        make_uint4(out[0], out[1], out[2], out[3]);
  }
}

template <bool kVec>
__global__ void __launch_bounds__(256)
    quantize_columns_kernel(const void* __restrict__ x, bool x_bf16, int64_t rows, int64_t cols,
                            int64_t ld_x, uint8_t* __restrict__ q, int64_t ld_q,
                            float* __restrict__ s, int64_t ld_s) {
  quantize_column_tile<kVec>(x, x_bf16, 0, rows, cols, ld_x, int64_t(blockIdx.y) * 128,
                             int64_t(blockIdx.x) * kColTileCols, q, ld_q,
                             s + int64_t(blockIdx.y) * ld_s);
}

// Whether the 128 × 1 quantisers may load four values at a time (their stores are always 16-byte
// runs).
bool columns_vector_ok(const void* x, bool x_bf16, int64_t cols, int64_t ld_x) {
  return cols % 4 == 0 && ld_x % 4 == 0 && reinterpret_cast<uintptr_t>(x) % (x_bf16 ? 8 : 16) == 0;
}

// ---- the groups' quantisations in one launch ---------------------------------------------------

// The group holding index i of the cumulative `starts` (starts[0] = 0 ≤ i < starts[groups]): the
// last g with starts[g] ≤ i, which skips empty groups (they start where the next one does).
__device__ __forceinline__ int group_of(const int32_t* starts, int groups, int64_t i) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The table is a __grid_constant__ parameter: indexed in place, never copied per thread.

// One warp per (padded row, 128-column tile), as quantize_tiles_kernel; a padding row gets code 0
// and scale 0.
template <bool kVec>
__global__ void __launch_bounds__(kTileWarps * 32)
    quantize_group_tiles_kernel(const void* __restrict__ x, bool x_bf16, int64_t cols, int64_t ld_x,
                                const __grid_constant__ GroupTable table, uint8_t* __restrict__ q,
                                float* __restrict__ s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t p = int64_t(blockIdx.x) * kTileWarps + warp;
  if (p >= table.padded[table.groups]) return;
  const int g = group_of(table.padded, table.groups, p);
  const int64_t local = p - table.padded[g];
  const int64_t rows_g = table.rows[g + 1] - table.rows[g];
  const int64_t ld_s = table.padded[g + 1] - table.padded[g];
  const int64_t col_tiles = (cols + 127) / 128, first_tile = int64_t(blockIdx.y) * kRowTiles;
  float* sg = s + int64_t(table.padded[g]) * col_tiles;
  if (local >= rows_g) {
    const float zeros[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t tile = first_tile; tile < first_tile + kRowTiles && tile < col_tiles; ++tile) {
      if (lane == 0) sg[tile * ld_s + local] = 0.0f;
      const int64_t c0 = tile * 128 + lane * 4;
      store4<kVec>(q, p * cols + c0, cols - c0, zeros, divisor_of(1.0f));
    }
    return;
  }
  quantize_row_tiles<kVec>(x, x_bf16, (table.rows[g] + local) * ld_x, cols, first_tile, q, p * cols,
                           sg + local, ld_s, lane);
}

// One block per (64 columns, 128-row tile of a group), as quantize_columns_kernel.
template <bool kVec>
__global__ void __launch_bounds__(256)
    quantize_group_columns_kernel(const void* __restrict__ x, bool x_bf16, int64_t cols,
                                  int64_t ld_x, const __grid_constant__ GroupTable table,
                                  uint8_t* __restrict__ q, float* __restrict__ s) {
  const int g = group_of(table.tiles, table.groups, blockIdx.y);
  const int64_t t = int64_t(blockIdx.y) - table.tiles[g];
  const int64_t ld_s = (cols + 3) / 4 * 4;
  // The group's codes start at padded[g] · cols, a multiple of 16 like its ld_q.
  quantize_column_tile<kVec>(
      x, x_bf16, int64_t(table.rows[g]) * ld_x, table.rows[g + 1] - table.rows[g], cols, ld_x,
      t * 128, int64_t(blockIdx.x) * kColTileCols, q + int64_t(table.padded[g]) * cols,
      table.padded[g + 1] - table.padded[g], s + (int64_t(table.tiles[g]) + t) * ld_s);
}

// ---- 128 × 1 tiles per group, the offsets on the device --------------------------------------

// tiles[g] = the 128-row tiles of the groups before g. One thread: at most a few hundred groups.
__global__ void token_tiles_kernel(const int32_t* __restrict__ offsets, int groups,
                                   int32_t* __restrict__ tiles) {
  if (threadIdx.x != 0) return;
  int32_t sum = 0;
  tiles[0] = 0;
  for (int g = 0; g < groups; ++g) {
    sum += (offsets[g + 1] - offsets[g] + 127) / 128;
    tiles[g + 1] = sum;
  }
}

// One block per (64 columns, 128-row tile j of all the groups' tiles), as quantize_columns_kernel;
// blocks past the last tile leave.
template <bool kVec>
__global__ void __launch_bounds__(256)
    quantize_device_group_columns_kernel(const void* __restrict__ x, bool x_bf16, int64_t cols,
                                         int64_t ld_x, const int32_t* __restrict__ offsets,
                                         int groups, const int32_t* __restrict__ tiles,
                                         uint8_t* __restrict__ q, int64_t ld_q,
                                         float* __restrict__ s, int64_t ld_s) {
  const int64_t j = blockIdx.y;
  if (j >= tiles[groups]) return;
  const int g = group_of(tiles, groups, j);
  const int64_t first_row = offsets[g];
  quantize_column_tile<kVec>(x, x_bf16, first_row * ld_x, offsets[g + 1] - first_row, cols, ld_x,
                             (j - tiles[g]) * 128, int64_t(blockIdx.x) * kColTileCols,
                             q + int64_t(tiles[g]) * 128, ld_q, s + j * ld_s);
}

// ---- transposes -----------------------------------------------------------------------------

// Matrix blockIdx.z of a batch: in + z · in_step, out + z · out_step.
template <typename T>
__global__ void transpose_kernel(const T* __restrict__ in, int64_t rows, int64_t cols,
                                 int64_t ld_in, int64_t in_step, T* __restrict__ out,
                                 int64_t ld_out, int64_t out_step) {
  __shared__ T tile[32][33];
  in += int64_t(blockIdx.z) * in_step;
  out += int64_t(blockIdx.z) * out_step;
  const int64_t r0 = int64_t(blockIdx.y) * 32, c0 = int64_t(blockIdx.x) * 32;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * ld_in + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out[c * ld_out + r] = tile[threadIdx.x][i];
  }
}

// Bytes in 64 × 64 tiles moved as 4-byte words both ways (a byte per thread moved the weights'
// codes at a fraction of the copy rate): 256 threads load 16 rows of 16 words a pass,
// then write 16 rows of the transpose a pass, each word gathered from four rows of the tile. For
// whole words only: rows and cols multiples of 4, every row and matrix 4-byte aligned.
__global__ void __launch_bounds__(256)
    transpose_u8_words_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols,
                              int64_t ld_in, int64_t in_step, uint8_t* __restrict__ out,
                              int64_t ld_out, int64_t out_step) {
  __shared__ uint32_t tile[64][17];  // row r's bytes 4w .. 4w + 3 at tile[r][w]
  in += int64_t(blockIdx.z) * in_step;
  out += int64_t(blockIdx.z) * out_step;
  const int64_t r0 = int64_t(blockIdx.y) * 64, c0 = int64_t(blockIdx.x) * 64;
  const int word = threadIdx.x & 15, line = threadIdx.x >> 4;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int r = line + 16 * p;
    const int64_t row = r0 + r, col = c0 + 4 * word;
    tile[r][word] =
        row < rows && col < cols ? *reinterpret_cast<const uint32_t*>(in + row * ld_in + col) : 0u;
  }
  __syncthreads();
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int c = line + 16 * p;
    const int64_t col = c0 + c, row = r0 + 4 * word;
    if (col >= cols || row >= rows) continue;
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      packed |= ((tile[4 * word + j][c >> 2] >> (8 * (c & 3))) & 0xffu) << (8 * j);
    *reinterpret_cast<uint32_t*>(out + col * ld_out + row) = packed;
  }
}

int64_t blocks_of(int64_t n, int64_t b) { return (n + b - 1) / b; }

// ---- dequantisation of stacked 128 × 128-block weights: kVec codes per thread ----------------

// The exact product of a code and its f32 scale (in double: 4 + 24 significant bits) rounded once.
__device__ __forceinline__ uint16_t dequantize_bf16(uint8_t code, float scale) {
  const __nv_bfloat16 h = __double2bfloat16(double(fp8e4m3_to_f32(code)) * double(scale));
  return *reinterpret_cast<const uint16_t*>(&h);
}

// One block per row: the row's piece and scale row are found once, so no thread divides by a
// 64-bit number; each thread then takes kVec codes of the row at a time.
template <int kVec, bool kF32Out>
__global__ void __launch_bounds__(256)
    dequantize_pieces_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                             int64_t cols, int64_t piece_rows, int64_t scale_rows,
                             int64_t scale_cols, void* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const int64_t piece = row / piece_rows, r = row - piece * piece_rows;
  const float* scale_row = scales + (piece * scale_rows + r / 128) * scale_cols;
  const uint8_t* in = codes + row * cols;
  for (int64_t col = int64_t(threadIdx.x) * kVec; col < cols; col += int64_t(blockDim.x) * kVec) {
    const float s = scale_row[col >> 7];
    uint8_t c[kVec];
    if constexpr (kVec == 8) {
      *reinterpret_cast<uint2*>(c) = *reinterpret_cast<const uint2*>(in + col);
    } else {
      c[0] = in[col];
    }
    const int64_t i = row * cols + col;
    if constexpr (kF32Out) {
#pragma unroll
      for (int v = 0; v < kVec; ++v)
        static_cast<float*>(out)[i + v] = bf16_to_f32(dequantize_bf16(c[v], s));
    } else {
      uint16_t h[kVec];
#pragma unroll
      for (int v = 0; v < kVec; ++v) h[v] = dequantize_bf16(c[v], s);
      if constexpr (kVec == 8)
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + i) = *reinterpret_cast<uint4*>(h);
      else
        static_cast<uint16_t*>(out)[i] = h[0];
    }
  }
}

template <typename T>
void transpose(const T* in, int64_t rows, int64_t cols, int64_t ld_in, int64_t in_step, T* out,
               int64_t ld_out, int64_t out_step, int64_t batch, cudaStream_t stream) {
  if (rows == 0 || cols == 0 || batch == 0) return;
  const dim3 grid(unsigned(blocks_of(cols, 32)), unsigned(blocks_of(rows, 32)), unsigned(batch));
  transpose_kernel<T>
      <<<grid, dim3(32, 8), 0, stream>>>(in, rows, cols, ld_in, in_step, out, ld_out, out_step);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_tiles(const void* x, bool x_bf16, int64_t rows, int64_t cols, int64_t ld_x,
                    uint8_t* q, int64_t ld_q, float* s, int64_t ld_s, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(unsigned(blocks_of(rows, kTileWarps)),
                  unsigned(blocks_of(blocks_of(cols, 128), kRowTiles)));
  const auto kernel = vector_ok(x, x_bf16, cols, ld_x, q, ld_q) ? quantize_tiles_kernel<true>
                                                                : quantize_tiles_kernel<false>;
  kernel<<<grid, kTileWarps * 32, 0, stream>>>(x, x_bf16, rows, cols, ld_x, q, ld_q, s, ld_s);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void quantize_blocks(const void* x, bool x_bf16, int64_t rows, int64_t cols, int64_t ld_x,
                     uint8_t* q, int64_t ld_q, float* s, int64_t ld_s, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(unsigned(blocks_of(cols, 128)), unsigned(blocks_of(rows, 128)));
  const auto kernel = vector_ok(x, x_bf16, cols, ld_x, q, ld_q) ? quantize_blocks_kernel<true>
                                                                : quantize_blocks_kernel<false>;
  kernel<<<grid, 256, 0, stream>>>(x, x_bf16, rows, cols, ld_x, q, ld_q, s, ld_s);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void quantize_columns(const void* x, bool x_bf16, int64_t rows, int64_t cols, int64_t ld_x,
                      uint8_t* q, int64_t ld_q, float* s, int64_t ld_s, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(unsigned(blocks_of(cols, kColTileCols)), unsigned(blocks_of(rows, 128)));
  const auto kernel = columns_vector_ok(x, x_bf16, cols, ld_x) ? quantize_columns_kernel<true>
                                                               : quantize_columns_kernel<false>;
  kernel<<<grid, 256, 0, stream>>>(x, x_bf16, rows, cols, ld_x, q, ld_q, s, ld_s);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void quantize_group_tiles(const void* x, bool x_bf16, int64_t cols, int64_t ld_x,
                          const GroupTable& table, uint8_t* q, float* s, cudaStream_t stream) {
  const int64_t padded = table.padded[table.groups];
  if (padded == 0 || cols == 0) return;
  const dim3 grid(unsigned(blocks_of(padded, kTileWarps)),
                  unsigned(blocks_of(blocks_of(cols, 128), kRowTiles)));
  const auto kernel = vector_ok(x, x_bf16, cols, ld_x, q, cols)
                          ? quantize_group_tiles_kernel<true>
                          : quantize_group_tiles_kernel<false>;
  kernel<<<grid, kTileWarps * 32, 0, stream>>>(x, x_bf16, cols, ld_x, table, q, s);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void quantize_group_columns(const void* x, bool x_bf16, int64_t cols, int64_t ld_x,
                            const GroupTable& table, uint8_t* q, float* s, cudaStream_t stream) {
  const int64_t tiles = table.tiles[table.groups];
  if (tiles == 0 || cols == 0) return;
  const dim3 grid(unsigned(blocks_of(cols, kColTileCols)), unsigned(tiles));
  const auto kernel = columns_vector_ok(x, x_bf16, cols, ld_x)
                          ? quantize_group_columns_kernel<true>
                          : quantize_group_columns_kernel<false>;
  kernel<<<grid, 256, 0, stream>>>(x, x_bf16, cols, ld_x, table, q, s);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void dequantize_pieces(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols,
                       int64_t piece_rows, bool f32_out, void* out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const int64_t scale_rows = blocks_of(piece_rows, 128), scale_cols = blocks_of(cols, 128);
  // Eight codes of one row and one 128-column block per thread when rows are whole vectors.
  const bool vec = cols % 8 == 0 && reinterpret_cast<uintptr_t>(codes) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  auto launch = [&](auto kernel) {
    kernel<<<unsigned(rows), 256, 0, stream>>>(codes, scales, cols, piece_rows, scale_rows,
                                               scale_cols, out);
  };
  if (vec)
    f32_out ? launch(dequantize_pieces_kernel<8, true>)
            : launch(dequantize_pieces_kernel<8, false>);
  else
    f32_out ? launch(dequantize_pieces_kernel<1, true>)
            : launch(dequantize_pieces_kernel<1, false>);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void quantize_device_group_columns(const void* x, bool x_bf16, int64_t rows, int64_t cols,
                                   int64_t ld_x, const int32_t* offsets, int groups, int32_t* tiles,
                                   uint8_t* q, int64_t ld_q, float* s, int64_t ld_s,
                                   cudaStream_t stream) {
  token_tiles_kernel<<<1, 32, 0, stream>>>(offsets, groups, tiles);
  GLMTUNE_CUDA_CHECK_LAUNCH();
  if (rows == 0 || cols == 0) return;
  const dim3 grid(unsigned(blocks_of(cols, kColTileCols)), unsigned(blocks_of(rows, 128) + groups));
  if (columns_vector_ok(x, x_bf16, cols, ld_x))
    quantize_device_group_columns_kernel<true>
        <<<grid, 256, 0, stream>>>(x, x_bf16, cols, ld_x, offsets, groups, tiles, q, ld_q, s, ld_s);
  else
    quantize_device_group_columns_kernel<false>
        <<<grid, 256, 0, stream>>>(x, x_bf16, cols, ld_x, offsets, groups, tiles, q, ld_q, s, ld_s);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void transpose_u8(const uint8_t* in, int64_t rows, int64_t cols, int64_t ld_in, uint8_t* out,
                  int64_t ld_out, cudaStream_t stream, int64_t batch, int64_t in_step,
                  int64_t out_step) {
  const auto words = [](int64_t v) { return v % 4 == 0; };
  if (!(words(rows) && words(cols) && words(ld_in) && words(ld_out) && words(in_step) &&
        words(out_step) && reinterpret_cast<uintptr_t>(in) % 4 == 0 &&
        reinterpret_cast<uintptr_t>(out) % 4 == 0))
    throw_internal(__FILE__, __LINE__,
                   "transpose_u8: a [" + std::to_string(rows) + ", " + std::to_string(cols) +
                       "] byte matrix (pitches " + std::to_string(ld_in) + " / " +
                       std::to_string(ld_out) + ") is not in whole 4-byte words");
  if (rows == 0 || cols == 0 || batch == 0) return;
  const dim3 grid(unsigned(blocks_of(cols, 64)), unsigned(blocks_of(rows, 64)), unsigned(batch));
  transpose_u8_words_kernel<<<grid, 256, 0, stream>>>(in, rows, cols, ld_in, in_step, out, ld_out,
                                                      out_step);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void transpose_f32(const float* in, int64_t rows, int64_t cols, int64_t ld_in, float* out,
                   int64_t ld_out, cudaStream_t stream, int64_t batch, int64_t in_step,
                   int64_t out_step) {
  transpose(in, rows, cols, ld_in, in_step, out, ld_out, out_step, batch, stream);
}

}  // namespace glmtune::cuda::fp8_kernels

#pragma once
// Grouped block-scaled FP8 GEMMs on Hopper's warpgroup MMA, the groups' row offsets read on the
// device (ops/cuda/fp8.h, "grouped, offsets on the device"): one launch for every expert.
//
//   forward / dX:  y[rows_g, N] = x[rows_g, K] · w_g[N, K]ᵀ
//   dW:            dw[g][N, K] (+)= dy_gᵀ · x_g, reduced over the group's rows (tokens)
//
// Forward and dX: x e4m3 codes [T, K] with one f32 scale per row and 128 columns (1 × 128 tiles;
// the scale of tile (r, b) at b · ld + r); w every group's [N, K] stacked as one [G · N, K] matrix
// of e4m3 codes in 128 × 128 blocks (block (i, j) of the stack at i · ld + j), N a multiple of 128
// so that no block spans two groups. The input gradient is the same product with w_g's transpose.
// dW: dy and x quantised in 128 × 1 tiles per group from its first row and stored transposed, all
// groups in one matrix: codes [N or K, P], group g's rows at columns 128 · tiles[g] .. (zero past
// its last row up to the next multiple of 128), scales [P / 128, ld] (the columns fastest), where
// tiles[g] counts the 128-row tiles of the groups before g (on the device).
//
// One persistent block per SM in three warpgroups, the shape of the bf16 kernels of
// ops/cuda/grouped_gemm_sm90.cuh: two consumers that each multiply 64 rows of the block's
// 128 × 128 output tile, and a third whose first thread loads the codes of A and B (128 × 128
// bytes each, 128-byte swizzled) and A's 128 row scales of a k block by TMA into a five-stage
// ring (dW: B's 128 column scales too) while its other three warps store the finished tile under
// the next tile's products.
//
// The scales: e4m3 products are summed in f32 by the tensor cores without them, so each k block
// of 128 is multiplied into a second set of accumulators (four m64n128k32 steps, the first of
// which replaces what the set held), then added into the tile's accumulators times
// scale_a(row, k block) · scale_b(column, k block). In the forward a weight block covers the
// tile's 128 columns, so a thread needs the one B scale and the A scales of its two rows; in dW
// each of its 32 columns has its own. The order of the f32 sums is fixed per output tile, so
// reruns are bit-identical.
//
// Row tiles may run past their group into the next one's rows: those rows are computed and not
// stored. TMA fills past a tensor's edge with zeros, so K needs no multiple of 128 (a partial k
// block's missing codes are 0).

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "glmtune/ops/cuda/grouped_gemm_sm90.cuh"
#include "glmtune/ops/cuda/wgmma.cuh"

namespace glmtune::cuda::sm90 {
namespace grouped_fp8 {

constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 128;  // k in elements, which are bytes
constexpr int kStages = 5;
constexpr int kThreads = 384;
constexpr int kABytes = kBlockM * kBlockK;  // 16 KB
constexpr int kBBytes = kBlockN * kBlockK;  // 16 KB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kScaleBytes = 2 * kBlockM * 4;  // a stage's row scales of A (and dW's of B)
// A tensor copy must start at a 16-byte aligned address in the innermost dimension, and a group's
// first row is any row: the forward's A scales are loaded from the row tile's first row rounded
// down to a multiple of 4, four more than the tile's 128 (dW's row tiles start at multiples of
// 128).
constexpr int kRowScaleBox = kBlockM + 4;
constexpr int kMaxGroups = 1024;
constexpr int kConsumerRegisters = 224;
constexpr int kProducerRegisters = 56;
static_assert(2 * 128 * kConsumerRegisters + 128 * kProducerRegisters <= kThreads * 168);
constexpr int kBatch = 2;  // output chunks an epilogue thread moves at a time
// The output tile on its way out: 128 rows of 256 bytes (128 bf16, or per round 64 f32 columns)
// padded by 16 bytes, so that the accumulators' stores of eight rows fall in distinct banks.
constexpr int kStageRowBytes = 256 + 16;
constexpr int kOutBytes = kBlockM * kStageRowBytes;
constexpr int kEpilogueThreads = 96;  // the producer warpgroup's warps 1 .. 3
constexpr int kSmemBytes = kStages * (kStageBytes + kScaleBytes) + kOutBytes +
                           (2 * kStages + 2) * 8 + (kMaxGroups + 1) * 4 + 1024;

struct Args {
  const int32_t* offsets;  // [groups + 1] on the device, nondecreasing, rows of x and y
  int groups;
  // Forward: y [rows, n], the stack of B [groups · n, k]. dW: dw [groups, n, k].
  int64_t n, k;
  const float* b_scales;  // forward: block (i, j) of the stack at i · b_scales_ld + j
  int64_t b_scales_ld;
  const int32_t* token_tiles;  // dW: [groups + 1], cumulative ceil(rows_g / 128), on the device
  void* out;                   // bf16 or f32
  bool out_f32;
  bool accumulate;  // add into the output
  int band_rows;    // row tiles per band of the tile order (at least 1)
};
constexpr int kDefaultBandRows = 8;

struct Tile {
  int group;
  int64_t row0, col0;  // first output row and column (dW: of dw[group])
  int64_t row_end;     // output rows from row_end on are not stored
  int k0, k_tiles;     // the reduction's first 128-wide block and their count
};

// Tiles by group, each group's in bands of band_rows row tiles with the column tiles first within
// a band (ops/cuda/grouped_gemm_sm90.cuh says why).
template <bool kWeightGrad>
__device__ __forceinline__ Tile tile_at(const Args& a, const int32_t* prefix, int64_t t) {
  const int lo = grouped::group_of_tile(prefix, a.groups, t);
  const int64_t r0 = a.offsets[lo], r1 = a.offsets[lo + 1];
  const int64_t m_tiles = kWeightGrad ? a.n / kBlockM : (r1 - r0 + kBlockM - 1) / kBlockM;
  int64_t row_tile, col_tile;
  grouped::banded_place(t - prefix[lo], m_tiles, (kWeightGrad ? a.k : a.n) / kBlockN, a.band_rows,
                        row_tile, col_tile);
  Tile tile;
  tile.group = lo;
  tile.row0 = (kWeightGrad ? 0 : r0) + row_tile * kBlockM;
  tile.col0 = col_tile * kBlockN;
  if constexpr (kWeightGrad) {
    tile.row_end = a.n;
    tile.k0 = a.token_tiles[lo];
    tile.k_tiles = a.token_tiles[lo + 1] - tile.k0;
  } else {
    tile.row_end = r1;
    tile.k0 = 0;
    tile.k_tiles = int((a.k + kBlockK - 1) / kBlockK);
  }
  return tile;
}

}  // namespace grouped_fp8

// Forward: map_a x's codes [T, k] u8, map_b the stack [groups · n, k] u8 (boxes 128 × 128,
// 128-byte swizzled), map_sa x's scales [ceil(k / 128), ld] f32 (box kRowScaleBox × 1, from the
// row tile's first row rounded down to a multiple of 4); map_sb unused.
// dW: map_a dy's codes [n, P], map_b x's [k, P], map_sa and map_sb their scales [P / 128, ld].
template <bool kWeightGrad>
__global__ void __launch_bounds__(grouped_fp8::kThreads, 1)
    grouped_fp8_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_sa,
                            const __grid_constant__ CUtensorMap map_sb, grouped_fp8::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace grouped_fp8;
  unsigned char* smem = grouped::smem_1024();
  float* a_scales = reinterpret_cast<float*>(smem + kStages * kStageBytes);
  unsigned char* staging = smem + kStages * (kStageBytes + kScaleBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + kOutBytes);
  uint64_t* empty = full + kStages;
  uint64_t* out_full = empty + kStages;
  uint64_t* out_empty = out_full + 1;
  int32_t* prefix = reinterpret_cast<int32_t*>(out_empty + 1);
  const int warpgroup = threadIdx.x / 128;

  for (int g = threadIdx.x; g < a.groups; g += kThreads) {
    const int64_t rows = a.offsets[g + 1] - a.offsets[g];
    // dW: every tile of dw[g] for a group with rows; else the group's row tiles by N's columns.
    prefix[g + 1] = kWeightGrad ? int32_t(rows > 0 ? a.n / kBlockM * (a.k / kBlockN) : 0)
                                : int32_t((rows + kBlockM - 1) / kBlockM * (a.n / kBlockN));
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      wgmma::mbarrier_init(&full[s], 1);
      wgmma::mbarrier_init(&empty[s], 8);  // each consumer warp, once it has read the stage
    }
    wgmma::mbarrier_init(out_full, 256);
    wgmma::mbarrier_init(out_empty, kEpilogueThreads);
    wgmma::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int g = 0; g < a.groups; ++g) prefix[g + 1] += prefix[g];
  }
  __syncthreads();
  const int64_t total = prefix[a.groups];
  // f32 tiles leave in two rounds of 64 columns, bf16 ones in one of 128.
  const int rounds = a.out_f32 ? 2 : 1;

  if (warpgroup == 2 && threadIdx.x >= 256 + 32) {
    // Epilogue warps: staged tiles out to global memory, 16 bytes a thread, row-contiguous.
    wgmma::give_back_registers<kProducerRegisters>();
    const int e0 = threadIdx.x - (256 + 32);
    int out_phase = 0;
    const int64_t out_cols = kWeightGrad ? a.k : a.n;
    for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = tile_at<kWeightGrad>(a, prefix, t);
      unsigned char* out = static_cast<unsigned char*>(a.out);
      if constexpr (kWeightGrad) out += int64_t(tile.group) * a.n * a.k * (a.out_f32 ? 4 : 2);
      for (int r = 0; r < rounds; ++r) {
        wgmma::mbarrier_wait(out_full, out_phase);
        out_phase ^= 1;
        for (int e = e0; e < kBlockM * 16; e += kBatch * kEpilogueThreads) {
          uint4 v[kBatch], old[kBatch];
          int64_t at[kBatch];
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const int c = e + j * kEpilogueThreads;
            const int row = c >> 4, chunk = c & 15;
            const int64_t grow = tile.row0 + row;
            const int64_t col = tile.col0 + (a.out_f32 ? 64 * r + 4 * chunk : 8 * chunk);
            const bool inside = c < kBlockM * 16 && grow < tile.row_end;
            at[j] = inside ? (grow * out_cols + col) * (a.out_f32 ? 4 : 2) : -1;
            if (inside) {
              v[j] = *reinterpret_cast<const uint4*>(staging + row * kStageRowBytes + chunk * 16);
              if (a.accumulate) old[j] = *reinterpret_cast<const uint4*>(out + at[j]);
            }
          }
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            if (at[j] < 0) continue;
            const uint4 o = a.accumulate ? grouped::add_chunks(v[j], old[j], a.out_f32) : v[j];
            *reinterpret_cast<uint4*>(out + at[j]) = o;
          }
        }
        wgmma::mbarrier_arrive(out_empty);
      }
    }
    return;
  }
  if (warpgroup == 2) {
    // Producer: one thread issues every load.
    wgmma::give_back_registers<kProducerRegisters>();
    if (threadIdx.x != 256) return;
    int stage = 0, phase = 0;
    for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = tile_at<kWeightGrad>(a, prefix, t);
      const int b_row = kWeightGrad ? int(tile.col0) : int(int64_t(tile.group) * a.n + tile.col0);
      for (int kt = 0; kt < tile.k_tiles; ++kt) {
        const int kb = tile.k0 + kt;
        wgmma::mbarrier_wait(&empty[stage], phase ^ 1);
        grouped::expect_bytes(&full[stage],
                              kStageBytes + (kWeightGrad ? 2 * kBlockM : kRowScaleBox) * 4);
        unsigned char* sa = smem + stage * kStageBytes;
        float* scales = a_scales + stage * 2 * kBlockM;
        grouped::tma_2d(sa, &map_a, kb * kBlockK, int(tile.row0), &full[stage]);
        grouped::tma_2d(sa + kABytes, &map_b, kb * kBlockK, b_row, &full[stage]);
        grouped::tma_2d(scales, &map_sa, kWeightGrad ? int(tile.row0) : int(tile.row0) & ~3, kb,
                        &full[stage]);
        if constexpr (kWeightGrad)
          grouped::tma_2d(scales + kBlockM, &map_sb, int(tile.col0), kb, &full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // Consumers: warpgroup w owns output rows 64w .. 64w + 63 of each tile.
  wgmma::take_registers<kConsumerRegisters>();
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  // Accumulator element e of a thread is row row_base + 8 · ((e / 2) mod 2), column 8 · (e / 4) +
  // 2 · (lane mod 4) + (e mod 2) of the warpgroup's 64 × 128.
  const int row_base = 64 * warpgroup + 16 * warp + (lane >> 2);
  int stage = 0, phase = 0, out_phase = 0;
  float acc[64], part[64];
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = tile_at<kWeightGrad>(a, prefix, t);
    const float* b_scale_row =
        kWeightGrad
            ? nullptr
            : a.b_scales + ((int64_t(tile.group) * a.n + tile.col0) / kBlockN) * a.b_scales_ld;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    float b_next = kWeightGrad ? 1.0f : __ldg(b_scale_row);
    for (int kt = 0; kt < tile.k_tiles; ++kt) {
      const float b_scale = b_next;
      if (!kWeightGrad && kt + 1 < tile.k_tiles) b_next = __ldg(b_scale_row + kt + 1);
      wgmma::mbarrier_wait(&full[stage], phase);
      unsigned char* sa = smem + stage * kStageBytes;
      wgmma::fence();
#pragma unroll
      for (int j = 0; j < kBlockK / 32; ++j)
        wgmma::mma_m64n128k32_e4m3(part,
                                   wgmma::desc_k_major(sa + warpgroup * (kABytes / 2) + j * 32),
                                   wgmma::desc_k_major(sa + kABytes + j * 32), j == 0);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::pin(part);
      const float* sc = a_scales + stage * 2 * kBlockM;
      const int shift = kWeightGrad ? 0 : int(tile.row0 & 3);  // where the tile's first row landed
      const float s0 = sc[row_base + shift] * b_scale, s1 = sc[row_base + shift + 8] * b_scale;
      if constexpr (kWeightGrad) {
        // Column 8c + 2 · (lane mod 4) + i of element 4c + 2h + i.
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const float2 col =
              *reinterpret_cast<const float2*>(sc + kBlockM + 8 * c + 2 * (lane & 3));
          acc[4 * c] += part[4 * c] * (s0 * col.x);
          acc[4 * c + 1] += part[4 * c + 1] * (s0 * col.y);
          acc[4 * c + 2] += part[4 * c + 2] * (s1 * col.x);
          acc[4 * c + 3] += part[4 * c + 3] * (s1 * col.y);
        }
        __syncwarp();
        if (lane == 0) wgmma::mbarrier_arrive(&empty[stage]);
      } else {
        __syncwarp();
        if (lane == 0) wgmma::mbarrier_arrive(&empty[stage]);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] += part[i] * ((i & 2) ? s1 : s0);
      }
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    for (int r = 0; r < rounds; ++r) {
      wgmma::mbarrier_wait(out_empty, out_phase ^ 1);
      out_phase ^= 1;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned char* row = staging + (row_base + 8 * h) * kStageRowBytes;
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const float v0 = acc[4 * c + 2 * h], v1 = acc[4 * c + 2 * h + 1];
          const int col = 8 * c + 2 * (lane & 3);
          if (a.out_f32) {
            if ((c >> 3) == r)
              *reinterpret_cast<float2*>(row + (col - 64 * r) * 4) = make_float2(v0, v1);
          } else {
            *reinterpret_cast<__nv_bfloat162*>(row + col * 2) = __floats2bfloat162_rn(v0, v1);
          }
        }
      }
      wgmma::mbarrier_arrive(out_full);
    }
  }
#endif
}

namespace grouped_fp8 {

// A row-major byte matrix [rows, cols] in 128-byte-swizzled boxes of 128 columns × 128 rows.
inline CUresult map_codes(CUtensorMap* map, const void* base, int64_t rows, int64_t cols,
                          int64_t ld) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld)};
  const cuuint32_t box[2] = {kBlockK, kBlockM};
  return grouped::encode_map(map, 2, const_cast<void*>(base), dims, strides, box,
                             CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

// Scales [k blocks, ld] f32 with the rows (dW: the columns) fastest, in boxes of `box_rows` of one
// k block (unswizzled: contiguous bytes).
inline CUresult map_row_scales(CUtensorMap* map, const float* base, int64_t k_blocks, int64_t ld,
                               int box_rows) {
  const cuuint64_t dims[2] = {cuuint64_t(ld), cuuint64_t(k_blocks)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 4};
  const cuuint32_t box[2] = {cuuint32_t(box_rows), 1};
  return grouped::encode_map(map, 2, const_cast<float*>(base), dims, strides, box,
                             CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE);
}

}  // namespace grouped_fp8

// The launches. Forward / dX: x's codes [rows, a.k] (row pitch x_ld) and scales (pitch
// x_scales_ld, the rows fastest), the stack's codes [a.groups · a.n, a.k] (row pitch a.k). Returns
// false when a map cannot be made (an address or pitch TMA cannot take); nothing is launched then.
inline bool launch_grouped_fp8_gemm(const void* x_codes, int64_t rows, int64_t x_ld,
                                    const float* x_scales, int64_t x_scales_ld, const void* w_codes,
                                    grouped_fp8::Args a, int blocks, cudaStream_t stream) {
  using namespace grouped_fp8;
  CUtensorMap map_a, map_b, map_sa;
  if (map_codes(&map_a, x_codes, rows, a.k, x_ld) != CUDA_SUCCESS ||
      map_codes(&map_b, w_codes, int64_t(a.groups) * a.n, a.k, a.k) != CUDA_SUCCESS ||
      map_row_scales(&map_sa, x_scales, (a.k + kBlockK - 1) / kBlockK, x_scales_ld, kRowScaleBox) !=
          CUDA_SUCCESS)
    return false;
  if (a.band_rows <= 0) a.band_rows = kDefaultBandRows;
  cudaFuncSetAttribute(grouped_fp8_gemm_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       kSmemBytes);
  grouped_fp8_gemm_kernel<false>
      <<<blocks, kThreads, kSmemBytes, stream>>>(map_a, map_b, map_sa, map_sa, a);
  return true;
}

// dW: dy's and x's transposed codes [a.n, padded] and [a.k, padded] (row pitch `padded`), their
// scales [padded / 128, dy_scales_ld] and [padded / 128, x_scales_ld].
inline bool launch_grouped_fp8_weight_grad(const void* dy_codes, const float* dy_scales,
                                           int64_t dy_scales_ld, const void* x_codes,
                                           const float* x_scales, int64_t x_scales_ld,
                                           int64_t padded, grouped_fp8::Args a, int blocks,
                                           cudaStream_t stream) {
  using namespace grouped_fp8;
  CUtensorMap map_a, map_b, map_sa, map_sb;
  if (map_codes(&map_a, dy_codes, a.n, padded, padded) != CUDA_SUCCESS ||
      map_codes(&map_b, x_codes, a.k, padded, padded) != CUDA_SUCCESS ||
      map_row_scales(&map_sa, dy_scales, padded / kBlockK, dy_scales_ld, kBlockM) != CUDA_SUCCESS ||
      map_row_scales(&map_sb, x_scales, padded / kBlockK, x_scales_ld, kBlockM) != CUDA_SUCCESS)
    return false;
  if (a.band_rows <= 0) a.band_rows = kDefaultBandRows;
  cudaFuncSetAttribute(grouped_fp8_gemm_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       kSmemBytes);
  grouped_fp8_gemm_kernel<true>
      <<<blocks, kThreads, kSmemBytes, stream>>>(map_a, map_b, map_sa, map_sb, a);
  return true;
}

}  // namespace glmtune::cuda::sm90

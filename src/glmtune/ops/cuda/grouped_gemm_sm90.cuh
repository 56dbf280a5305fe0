#pragma once
// Grouped expert GEMMs on Hopper's warpgroup MMA with the groups' row offsets read on the device
// (ops/cuda/grouped_gemm.h): the host never needs the offsets, so the MoE does not synchronise.
//
// One persistent block per SM in three warpgroups: two consumers that each multiply 64 rows of
// the block's 128 × 256 output tile (m64n256k16, fp32 accumulators in registers) and leave them
// in shared memory, and a third whose first thread loads operand tiles with TMA into a
// three-stage ring (completing on mbarriers) while its other three warps store the finished tile
// to global memory under the next tile's products (bf16 in one round, f32 in two of 128 columns).
// The f32 weight gradient, which adds to what is there, leaves instead by TMA reductions (the add
// happens in L2, no thread waits on a load): the consumers stage it in 128-byte-swizzled boxes of
// 32 columns and one thread of the third warpgroup issues them.
// Each block walks the tile list with a stride of the grid; every block derives the list from the
// offsets at its start. The list takes the groups in order and each group's tiles in bands of
// `band_rows` row tiles, column tiles first within a band: the blocks that run at once then share
// a band of the first operand and every column of the second in L2, where walking all rows of one
// column first read a group's whole first operand again for every column tile (a group of 16 K
// rows and 4,096 columns: 128 MB, more than L2, sixteen times).
//
//   kForward:        y[rows_g, N]  (+)= x[rows_g, K] · w[g]^T   tiles over (rows_g, N), k over K
//   kBackwardInput:  dx[rows_g, K] (+)= dy[rows_g, N] · w[g]    tiles over (rows_g, K), k over N
//   kBackwardWeight: dw[g]         += dy[rows_g, N]^T · x[rows_g, K]
//                                                    tiles over (N, K), k over the group's rows
//
// Row tiles of the first two modes may run past their group into the next one's rows: those
// output rows are computed and not stored. The weight gradient reduces over exactly its group's
// rows: the rows of a k tile past the group's end are zeroed in shared memory before the products
// read them. TMA fills everything past a tensor's edge with zeros, so no size needs to be a
// multiple of a tile; the row strides must be multiples of 16 bytes (8 bf16) for TMA.

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "glmtune/ops/cuda/wgmma.cuh"

namespace glmtune::cuda::sm90 {

enum class GroupedMode { kForward, kBackwardInput, kBackwardWeight };

namespace grouped {

constexpr int kBlockM = 128, kBlockN = 256, kBlockK = 64;
constexpr int kStages = 3;
constexpr int kThreads = 384;
constexpr int kABytes = kBlockM * kBlockK * 2;  // 16 KB
constexpr int kBBytes = kBlockN * kBlockK * 2;  // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kMaxGroups = 1024;
// Registers a thread after the reallocation: together no more than the launch gives the block
// (168 a thread under __launch_bounds__(384, 1)), or the consumers' request never completes.
constexpr int kConsumerRegisters = 224;
constexpr int kProducerRegisters = 56;
constexpr int kBatch = 2;  // output chunks an epilogue thread moves at a time
static_assert(2 * 128 * kConsumerRegisters + 128 * kProducerRegisters <= kThreads * 168);
// The output tile on its way out: 128 rows of 512 bytes (256 bf16 or, per round, 128 f32
// columns) padded by 16 bytes, so that the accumulators' stores hit 32 distinct banks.
constexpr int kStageRowBytes = 512 + 16;
constexpr int kOutBytes = kBlockM * kStageRowBytes;
constexpr int kEpilogueThreads = 96;  // the producer warpgroup's warps 1 .. 3
// Stages, output staging, barriers and the tile table (prefix[kMaxGroups + 1]), from a 1024-byte
// boundary.
constexpr int kSmemBytes =
    kStages * kStageBytes + kOutBytes + (2 * kStages + 2) * 8 + (kMaxGroups + 1) * 4 + 1024;

struct Args {
  const int32_t* offsets;  // [groups + 1] on the device, nondecreasing from 0
  int groups;
  int64_t rows;  // rows of the segmented operands (offsets[groups])
  int64_t n, k;  // w is [groups, n, k]; the weight gradient dw is [groups, n, k] too
  void* out;     // y [rows, n] / dx [rows, k] bf16, dw [groups, n, k] f32 or bf16
  bool out_f32;
  bool accumulate;  // add into out (always for the weight gradient)
  bool reduce_out;  // the f32 weight gradient by TMA reductions through the output map
  int band_rows;    // row tiles per band of the tile order (at least 1)
};
constexpr int kDefaultBandRows = 8;

// The TMA reductions' staging: per round, four boxes of 128 rows × 32 f32 columns, 16 KB each,
// 128-byte swizzled (16-byte chunk j of row r at chunk j ^ (r mod 8)), so that the accumulators'
// stores of eight rows fall in distinct banks without padding.
constexpr int kReduceBoxCols = 32;
constexpr int kReduceBoxBytes = kBlockM * kReduceBoxCols * 4;
static_assert(4 * kReduceBoxBytes <= kOutBytes);

__device__ __forceinline__ unsigned char* smem_1024() {
  extern __shared__ unsigned char smem_raw[];
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                          ~uintptr_t(1023));
}

__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(wgmma::smem_u32(bar)),
      "r"(bytes)
      : "memory");
}

// The 16-byte chunk v plus old, element by element: four f32 or eight bf16 (each sum of two bf16
// rounded once), as an epilogue adds a tile into what its output holds.
__device__ __forceinline__ uint4 add_chunks(const uint4& v, const uint4& old, bool f32) {
  uint4 o;
  if (f32) {
    const float* x = reinterpret_cast<const float*>(&v);
    const float* y = reinterpret_cast<const float*>(&old);
    float* z = reinterpret_cast<float*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) z[i] = x[i] + y[i];
  } else {
    const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&v);
    const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&old);
    __nv_bfloat162* z = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 fx = __bfloat1622float2(x[i]), fy = __bfloat1622float2(y[i]);
      z[i] = __floats2bfloat162_rn(fx.x + fy.x, fx.y + fy.y);
    }
  }
  return o;
}

__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                       uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(wgmma::smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(wgmma::smem_u32(bar))
      : "memory");
}

// dst[c0 .., c1 .., c2] += the box at src (f32 adds in L2), tracked by the thread's bulk group.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0,
                                                  int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], "
      "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(wgmma::smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// The committed reductions have read their shared memory (kRead) or are complete.
template <bool kRead>
__device__ __forceinline__ void bulk_wait_all() {
  if constexpr (kRead)
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void tma_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                       uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(wgmma::smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(wgmma::smem_u32(bar))
      : "memory");
}

// One output tile: its group, the first output row and column, the k range (first row of the
// reduction and number of k tiles) and the rows that belong to the group.
struct Tile {
  int group;
  int64_t row0;  // first output row (row of the segmented operand, or of dw[group])
  int64_t col0;
  int64_t k0;       // first reduction index (a row of the segmented operands for kBackwardWeight)
  int k_tiles;      // 64-wide reduction steps
  int64_t k_end;    // reduction indices from k_end on are zeroed (kBackwardWeight only)
  int64_t row_end;  // output rows from row_end on are not stored
};

// The group of tile t: the last g with prefix[g] <= t (prefix[g] = the tiles of the groups before
// g, so empty groups are skipped).
__device__ __forceinline__ int group_of_tile(const int32_t* prefix, int groups, int64_t t) {
  int lo = 0, hi = groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (prefix[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Row tile and column tile of a group's tile `local` (of m_tiles × col_tiles) in the banded order
// (see the top of the file).
__device__ __forceinline__ void banded_place(int64_t local, int64_t m_tiles, int64_t col_tiles,
                                             int band_rows, int64_t& row_tile, int64_t& col_tile) {
  const int64_t band = local / (band_rows * col_tiles);
  const int64_t first_row = band * band_rows;
  const int64_t rows = m_tiles - first_row < band_rows ? m_tiles - first_row : band_rows;
  const int64_t within = local - first_row * col_tiles;
  col_tile = within / rows;
  row_tile = first_row + within % rows;
}

template <GroupedMode kMode>
__device__ __forceinline__ Tile tile_at(const Args& a, const int32_t* prefix, int64_t t) {
  const int lo = group_of_tile(prefix, a.groups, t);
  Tile tile;
  tile.group = lo;
  const int64_t local = t - prefix[lo];
  const int64_t r0 = a.offsets[lo], r1 = a.offsets[lo + 1];
  const int64_t col_tiles = ((kMode == GroupedMode::kForward ? a.n : a.k) + kBlockN - 1) / kBlockN;
  const int64_t m_tiles =
      ((kMode == GroupedMode::kBackwardWeight ? a.n : r1 - r0) + kBlockM - 1) / kBlockM;
  int64_t row_tile, col_tile;
  banded_place(local, m_tiles, col_tiles, a.band_rows, row_tile, col_tile);
  tile.col0 = col_tile * kBlockN;
  if constexpr (kMode == GroupedMode::kBackwardWeight) {
    tile.row0 = row_tile * kBlockM;
    tile.row_end = a.n;
    tile.k0 = r0;
    tile.k_end = r1;
    tile.k_tiles = int((r1 - r0 + kBlockK - 1) / kBlockK);
  } else {
    tile.row0 = r0 + row_tile * kBlockM;
    tile.row_end = r1;
    tile.k0 = 0;
    const int64_t kdim = kMode == GroupedMode::kForward ? a.k : a.n;
    tile.k_end = kdim;
    tile.k_tiles = int((kdim + kBlockK - 1) / kBlockK);
  }
  return tile;
}

}  // namespace grouped

// The operand maps (all bf16, 128-byte swizzle):
//   kForward:        a = x  [rows, k] box 64 × 128;  b = w [groups, n, k] box 64 × 256 × 1
//   kBackwardInput:  a = dy [rows, n] box 64 × 128;  b = w [groups, n, k] box 64 × 64 × 1
//   kBackwardWeight: a = dy [rows, n] box 64 × 64;   b = x [rows, k] box 64 × 64
// and, with a.reduce_out, map_out = dw [groups, n, k] f32, box 32 × 128 × 1.
template <GroupedMode kMode>
__global__ void __launch_bounds__(grouped::kThreads, 1)
    grouped_gemm_wgmma_kernel(const __grid_constant__ CUtensorMap map_a,
                              const __grid_constant__ CUtensorMap map_b,
                              const __grid_constant__ CUtensorMap map_out, grouped::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace grouped;
  unsigned char* smem = smem_1024();
  unsigned char* staging = smem + kStages * kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + kOutBytes);
  uint64_t* empty = full + kStages;
  uint64_t* out_full = empty + kStages;  // the consumers' accumulators are in `staging`
  uint64_t* out_empty = out_full + 1;    // the epilogue warps have read them
  int32_t* prefix = reinterpret_cast<int32_t*>(out_empty + 1);
  const int warpgroup = threadIdx.x / 128;

  // The tile table: prefix[g] = tiles of the groups before g.
  const int64_t col_tiles = ((kMode == GroupedMode::kForward ? a.n : a.k) + kBlockN - 1) / kBlockN;
  for (int g = threadIdx.x; g < a.groups; g += kThreads) {
    const int64_t rows = a.offsets[g + 1] - a.offsets[g];
    int64_t tiles;
    if constexpr (kMode == GroupedMode::kBackwardWeight)
      tiles = rows > 0 ? (a.n + kBlockM - 1) / kBlockM * col_tiles : 0;
    else
      tiles = (rows + kBlockM - 1) / kBlockM * col_tiles;
    prefix[g + 1] = int32_t(tiles);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      wgmma::mbarrier_init(&full[s], 1);
      wgmma::mbarrier_init(&empty[s], 2);
    }
    wgmma::mbarrier_init(out_full, 256);
    wgmma::mbarrier_init(out_empty, a.reduce_out ? 1 : kEpilogueThreads);
    wgmma::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int g = 0; g < a.groups; ++g) prefix[g + 1] += prefix[g];
  }
  __syncthreads();
  const int64_t total = prefix[a.groups];
  // f32 tiles leave in two rounds of 128 columns, bf16 ones in one of 256.
  const int rounds = a.out_f32 ? 2 : 1;
  const int64_t ncols = kMode == GroupedMode::kForward ? a.n : a.k;

  if (warpgroup == 2 && threadIdx.x >= 256 + 32) {
    // Epilogue warps: staged tiles out to global memory, 16 bytes a thread and row-contiguous, so
    // that the stores run under the consumers' next products.
    wgmma::give_back_registers<kProducerRegisters>();
    const int e0 = threadIdx.x - (256 + 32);
    int out_phase = 0;
    if (a.reduce_out) {
      if (e0 != 0) return;
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const Tile tile = tile_at<kMode>(a, prefix, t);
        for (int r = 0; r < rounds; ++r) {
          wgmma::mbarrier_wait(out_full, out_phase);
          out_phase ^= 1;
          for (int b = 0; b < 4; ++b)
            tma_reduce_add_3d(&map_out, staging + b * kReduceBoxBytes,
                              int(tile.col0) + 128 * r + kReduceBoxCols * b, int(tile.row0),
                              tile.group);
          bulk_commit();
          bulk_wait_all<true>();  // the staging may be written again
          wgmma::mbarrier_arrive(out_empty);
        }
      }
      bulk_wait_all<false>();
      return;
    }
    unsigned char* out = static_cast<unsigned char*>(a.out);
    for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = tile_at<kMode>(a, prefix, t);
      unsigned char* base = out;
      if constexpr (kMode == GroupedMode::kBackwardWeight)
        base += int64_t(tile.group) * a.n * a.k * (a.out_f32 ? 4 : 2);
      for (int r = 0; r < rounds; ++r) {
        wgmma::mbarrier_wait(out_full, out_phase);
        out_phase ^= 1;
        // kBatch chunks a thread at a time, their loads issued together: one global load's
        // latency per batch, not per chunk (the weight gradient reads every f32 it adds to).
        for (int e = e0; e < kBlockM * 32; e += kBatch * kEpilogueThreads) {
          uint4 v[kBatch], old[kBatch];
          int64_t at[kBatch];
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const int c = e + j * kEpilogueThreads;
            const int row = c >> 5, chunk = c & 31;
            const int64_t grow = tile.row0 + row;
            const int64_t col = tile.col0 + (a.out_f32 ? 128 * r + 4 * chunk : 8 * chunk);
            const bool inside = c < kBlockM * 32 && grow < tile.row_end && col < ncols;
            at[j] = inside ? (grow * ncols + col) * (a.out_f32 ? 4 : 2) : -1;
            if (inside) {
              v[j] = *reinterpret_cast<const uint4*>(staging + row * kStageRowBytes + chunk * 16);
              if (a.accumulate) old[j] = *reinterpret_cast<const uint4*>(base + at[j]);
            }
          }
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            if (at[j] < 0) continue;
            const uint4 o = a.accumulate ? add_chunks(v[j], old[j], a.out_f32) : v[j];
            *reinterpret_cast<uint4*>(base + at[j]) = o;
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
      const Tile tile = tile_at<kMode>(a, prefix, t);
      for (int kt = 0; kt < tile.k_tiles; ++kt) {
        wgmma::mbarrier_wait(&empty[stage], phase ^ 1);
        expect_bytes(&full[stage], kStageBytes);
        unsigned char* sa = smem + stage * kStageBytes;
        unsigned char* sb = sa + kABytes;
        const int kk = int(tile.k0 + int64_t(kt) * kBlockK);
        if constexpr (kMode == GroupedMode::kForward) {
          tma_2d(sa, &map_a, kk, int(tile.row0), &full[stage]);
          tma_3d(sb, &map_b, kk, int(tile.col0), tile.group, &full[stage]);
        } else if constexpr (kMode == GroupedMode::kBackwardInput) {
          tma_2d(sa, &map_a, kk, int(tile.row0), &full[stage]);
          for (int p = 0; p < 4; ++p)
            tma_3d(sb + p * (kBBytes / 4), &map_b, int(tile.col0) + 64 * p, kk, tile.group,
                   &full[stage]);
        } else {
          for (int p = 0; p < 2; ++p)
            tma_2d(sa + p * (kABytes / 2), &map_a, int(tile.row0) + 64 * p, kk, &full[stage]);
          for (int p = 0; p < 4; ++p)
            tma_2d(sb + p * (kBBytes / 4), &map_b, int(tile.col0) + 64 * p, kk, &full[stage]);
        }
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // Consumers: warpgroup w owns output rows 64w .. 64w + 63 of each tile.
  wgmma::take_registers<kConsumerRegisters>();
  constexpr int kTransA = kMode == GroupedMode::kBackwardWeight ? 1 : 0;
  constexpr int kTransB = kMode == GroupedMode::kForward ? 0 : 1;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int thread_in_wg = threadIdx.x & 127;
  int stage = 0, phase = 0, out_phase = 0;
  float acc[128];
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = tile_at<kMode>(a, prefix, t);
    for (int kt = 0; kt < tile.k_tiles; ++kt) {
      wgmma::mbarrier_wait(&full[stage], phase);
      unsigned char* sa = smem + stage * kStageBytes;
      unsigned char* sb = sa + kABytes;
      if constexpr (kMode == GroupedMode::kBackwardWeight) {
        // Rows of the last k tile past the group's end belong to the next group: zero them in
        // both operands (each warpgroup its A panel and two of the four B panels).
        const int64_t valid = tile.k_end - (tile.k0 + int64_t(kt) * kBlockK);
        if (valid < kBlockK) {
          const int first = int(valid);
          uint4* pa = reinterpret_cast<uint4*>(sa + warpgroup * (kABytes / 2));
          for (int e = first * 8 + thread_in_wg; e < kBlockK * 8; e += 128)
            pa[e] = make_uint4(0, 0, 0, 0);
          for (int p = 2 * warpgroup; p < 2 * warpgroup + 2; ++p) {
            uint4* pb = reinterpret_cast<uint4*>(sb + p * (kBBytes / 4));
            for (int e = first * 8 + thread_in_wg; e < kBlockK * 8; e += 128)
              pb[e] = make_uint4(0, 0, 0, 0);
          }
          wgmma::fence_shared_for_async();
          wgmma::named_barrier<256>(1);
        }
      }
      wgmma::fence();
#pragma unroll
      for (int j = 0; j < kBlockK / 16; ++j) {
        uint64_t da, db;
        if constexpr (kTransA)
          da = wgmma::desc_mn_major(sa + warpgroup * (kABytes / 2) + j * 2048, kABytes / 2);
        else
          da = wgmma::desc_k_major(sa + warpgroup * (kABytes / 2) + j * 32);
        if constexpr (kTransB)
          db = wgmma::desc_mn_major(sb + j * 2048, kBBytes / 4);
        else
          db = wgmma::desc_k_major(sb + j * 32);
        wgmma::mma_m64n256k16<kTransA, kTransB>(acc, da, db, kt == 0 && j == 0);
      }
      wgmma::commit();
      // The previous stage's products are done: hand it back.
      wgmma::wait<1>();
      const int prev = stage == 0 ? kStages - 1 : stage - 1;
      if (kt > 0 && thread_in_wg == 0) wgmma::mbarrier_arrive(&empty[prev]);
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    wgmma::wait<0>();
    {
      const int prev = stage == 0 ? kStages - 1 : stage - 1;
      if (thread_in_wg == 0) wgmma::mbarrier_arrive(&empty[prev]);
    }
    wgmma::pin(acc);
    // Element e of the accumulators is row 16·warp + lane/4 + 8·((e/2) mod 2), column 8·(e/4) +
    // 2·(lane mod 4) + (e mod 2) of this warpgroup's 64 × 256.
    const int row_base = 64 * warpgroup + 16 * warp + (lane >> 2);
    for (int r = 0; r < rounds; ++r) {
      wgmma::mbarrier_wait(out_empty, out_phase ^ 1);
      out_phase ^= 1;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tile_row = row_base + 8 * h;
        unsigned char* row = staging + tile_row * kStageRowBytes;
        unsigned char* box_row = staging + tile_row * (kReduceBoxCols * 4);
#pragma unroll
        for (int c = 0; c < 32; ++c) {
          const float v0 = acc[4 * c + 2 * h], v1 = acc[4 * c + 2 * h + 1];
          const int col = 8 * c + 2 * (lane & 3);
          if (a.reduce_out) {
            if ((c >> 4) == r) {
              const int local = col - 128 * r, box = local / kReduceBoxCols;
              const int in_box = local % kReduceBoxCols;
              *reinterpret_cast<float2*>(box_row + box * kReduceBoxBytes +
                                         (((in_box >> 2) ^ (tile_row & 7)) << 4) +
                                         (in_box & 3) * 4) = make_float2(v0, v1);
            }
          } else if (a.out_f32) {
            if ((c >> 4) == r)
              *reinterpret_cast<float2*>(row + (col - 128 * r) * 4) = make_float2(v0, v1);
          } else {
            *reinterpret_cast<__nv_bfloat162*>(row + col * 2) = __floats2bfloat162_rn(v0, v1);
          }
        }
      }
      // The reductions read the staging through the async proxy.
      if (a.reduce_out) wgmma::fence_shared_for_async();
      wgmma::mbarrier_arrive(out_full);
    }
  }
#endif
}

// ---- host: the operand maps ---------------------------------------------------------------------

namespace grouped {

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
inline CUresult encode_map(CUtensorMap* map, int rank, void* base, const cuuint64_t* dims,
                           const cuuint64_t* strides_bytes, const cuuint32_t* box,
                           CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                           CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  using Encode =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode) return CUDA_ERROR_NOT_SUPPORTED;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, type, cuuint32_t(rank), base, dims, strides_bytes, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// A row-major bf16 matrix [rows, cols] in boxes of 64 columns × box_rows rows.
inline CUresult map_rows(CUtensorMap* map, const void* base, int64_t rows, int64_t cols,
                         int box_rows) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  return encode_map(map, 2, const_cast<void*>(base), dims, strides, box);
}

// Row-major bf16 matrices [groups, rows, cols] in boxes of 64 columns × box_rows rows of one.
inline CUresult map_groups(CUtensorMap* map, const void* base, int64_t groups, int64_t rows,
                           int64_t cols, int box_rows) {
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(groups)};
  const cuuint64_t strides[2] = {cuuint64_t(cols) * 2, cuuint64_t(cols) * cuuint64_t(rows) * 2};
  const cuuint32_t box[3] = {64, cuuint32_t(box_rows), 1};
  return encode_map(map, 3, const_cast<void*>(base), dims, strides, box);
}

// The f32 weight gradient dw [groups, n, k] in boxes of 32 columns × 128 rows of one group.
inline CUresult map_weight_grad_f32(CUtensorMap* map, void* base, int64_t groups, int64_t n,
                                    int64_t k) {
  const cuuint64_t dims[3] = {cuuint64_t(k), cuuint64_t(n), cuuint64_t(groups)};
  const cuuint64_t strides[2] = {cuuint64_t(k) * 4, cuuint64_t(k) * cuuint64_t(n) * 4};
  const cuuint32_t box[3] = {kReduceBoxCols, kBlockM, 1};
  return encode_map(map, 3, base, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
}

}  // namespace grouped

// The launch: `first` and `second` as in ops/cuda/grouped_gemm.h (x and w, dy and w, dy and x),
// `blocks` persistent blocks (the SM count). Returns false when a map cannot be made (a pointer
// or row stride TMA cannot address); nothing is launched then.
template <GroupedMode kMode>
inline bool launch_grouped_gemm(const void* first, const void* second, grouped::Args a, int blocks,
                                cudaStream_t stream) {
  using namespace grouped;
  CUtensorMap map_a, map_b, map_out{};
  CUresult ra, rb;
  if constexpr (kMode == GroupedMode::kForward) {
    ra = map_rows(&map_a, first, a.rows, a.k, kBlockM);
    rb = map_groups(&map_b, second, a.groups, a.n, a.k, kBlockN);
  } else if constexpr (kMode == GroupedMode::kBackwardInput) {
    ra = map_rows(&map_a, first, a.rows, a.n, kBlockM);
    rb = map_groups(&map_b, second, a.groups, a.n, a.k, 64);
  } else {
    ra = map_rows(&map_a, first, a.rows, a.n, 64);
    rb = map_rows(&map_b, second, a.rows, a.k, 64);
  }
  if (ra != CUDA_SUCCESS || rb != CUDA_SUCCESS) return false;
  if (a.band_rows <= 0) a.band_rows = kDefaultBandRows;
  // Adding f32 into dw: by TMA reductions when dw's rows suit a map (16-byte strides); otherwise
  // the epilogue warps read, add and store.
  a.reduce_out = kMode == GroupedMode::kBackwardWeight && a.out_f32 && a.accumulate &&
                 map_weight_grad_f32(&map_out, a.out, a.groups, a.n, a.k) == CUDA_SUCCESS;
  cudaFuncSetAttribute(grouped_gemm_wgmma_kernel<kMode>,
                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  grouped_gemm_wgmma_kernel<kMode>
      <<<blocks, kThreads, kSmemBytes, stream>>>(map_a, map_b, map_out, a);
  return true;
}

}  // namespace glmtune::cuda::sm90

#pragma once
// The sparse absorbed-latent attention on Hopper's warpgroup MMA (ops/cuda/mla.h), forward and
// backward. All operands sit in 128-byte-swizzled panels (ops/cuda/wgmma.cuh).

#include <cuda_bf16.h>

#include <cstdint>

#include "glmtune/ops/cuda/tensor_core.cuh"
#include "glmtune/ops/cuda/wgmma.cuh"

namespace glmtune::cuda::sm90 {

struct AbsorbedForwardArgs {
  const __nv_bfloat16* q;       // [T, NH, 512] q_abs
  const __nv_bfloat16* latent;  // [T, 512]
  const int32_t* keys;          // [T, width] selected key positions, count[i] of them valid
  const int32_t* counts;        // [T]
  int64_t width;
  int heads;
  float scale_log2;  // softmax scale · log2(e): scores are kept in base-2 units
};

// 2^x by the special function unit alone: exp2f adds a rescaling for results below 2^-126, four
// more instructions an exponential, which only produce subnormal probabilities (zero here).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

namespace absorbed_tiles {

constexpr int kR = 512;
constexpr int kHeads = 64;
constexpr int kKeys = 64;      // keys per block
constexpr int kThreads = 256;  // of the loaders below and the backward
constexpr int kPanels = kR / 64;
constexpr int kPanelBytes = 64 * 128;              // 64 rows of one 64-column panel
constexpr int kTileBytes = kPanels * kPanelBytes;  // 64 rows × 512 columns

// The dynamic shared memory from its first 1024-byte boundary (the swizzle's period). Offset
// from the array itself, so the compiler still knows the pointer is shared memory: accesses
// through it become 32-bit shared loads and stores, not generic ones with 64-bit addresses.
__device__ __forceinline__ unsigned char* smem_1024() {
  extern __shared__ unsigned char smem_raw[];
  return smem_raw + ((1024 - (wgmma::smem_u32(smem_raw) & 1023)) & 1023);
}

// Barrier of the whole block under another id than __syncthreads.
__device__ __forceinline__ void block_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// ROWS rows of 512 bf16 into a swizzled tile of eight 64-column panels (ROWS · 128 bytes each):
// row r from src(r), zeros where src(r) is null (a zero-filled copy still names a readable
// address, `fallback`). All 256 threads take part.
template <int ROWS = 64, typename Src>
__device__ __forceinline__ void load_rows(unsigned char* tile, const __nv_bfloat16* fallback,
                                          Src src) {
#pragma unroll 4
  for (int e = threadIdx.x; e < ROWS * (kR / 8); e += kThreads) {
    const int row = e >> 6, chunk = e & 63;
    const __nv_bfloat16* p = src(row);
    unsigned char* dst = tile + (chunk >> 3) * (ROWS * 128) + wgmma::swizzled(row, (chunk & 7) * 8);
    tc::cp_async16_zfill(dst, p ? p + chunk * 8 : fallback, p != nullptr);
  }
}

// The latent rows of one block of KEYS keys, their positions from shared memory (`positions`,
// 0 past the count, so every row names a readable address): a position read from global memory
// here would stall every thread's issue loop on its latency. Thread x copies the 16-byte chunk
// x mod 64 of rows x / 64, x / 64 + 4, ...: its destination column and its two swizzle patterns
// (rows 8n + x / 64 and 8n + 4 + x / 64) are fixed, so a copy costs a few instructions where the
// general loop spent about thirty on its addresses.
template <int KEYS>
__device__ __forceinline__ void load_keys(const __nv_bfloat16* latent, unsigned char* tile,
                                          const int32_t* positions, int block, int count) {
  constexpr int kRowStep = kThreads / 64;
  static_assert(kRowStep == 4 && KEYS % (2 * kRowStep) == 0);
  const int chunk = threadIdx.x & 63, first_row = threadIdx.x >> 6;
  const int rows = count - block * KEYS;  // valid rows of this block
  const uint32_t dst = wgmma::smem_u32(tile) + (chunk >> 3) * (KEYS * 128) + first_row * 128;
  const uint32_t dst_of_parity[2] = {dst + (((chunk & 7) ^ first_row) << 4),
                                     dst + (((chunk & 7) ^ (first_row + 4)) << 4)};
  const __nv_bfloat16* column = latent + chunk * 8;
#pragma unroll
  for (int k = 0; k < KEYS / kRowStep; ++k) {
    const int row = first_row + kRowStep * k;
    tc::cp_async16_zfill(dst_of_parity[k & 1] + k * kRowStep * 128,
                         column + uint32_t(positions[row]) * uint64_t(kR), row < rows);
  }
}

// The key positions of blocks 0 and 1 into positions[0 .. 2·KEYS).
template <int KEYS>
__device__ __forceinline__ void stage_first_positions(const int32_t* row, int count,
                                                      int32_t* positions) {
  if (threadIdx.x < 2 * KEYS)
    positions[threadIdx.x] = int(threadIdx.x) < count ? row[threadIdx.x] : 0;
}

// Thread r < KEYS: the position of key r of `block` (0 past the count), read from global memory
// a block ahead of its use.
template <int KEYS>
__device__ __forceinline__ int32_t prefetch_position(const int32_t* row, int block, int count) {
  const int slot = block * KEYS + int(threadIdx.x);
  return threadIdx.x < KEYS && slot < count ? row[slot] : 0;
}

}  // namespace absorbed_tiles

// ---- forward ------------------------------------------------------------------------------------
//
// Persistent blocks, one per SM, each taking the (query, 64 heads) items blockIdx.x, blockIdx.x +
// gridDim.x, ... in three warpgroups, arranged so that no iteration waits for its keys to be
// gathered and no item waits for its own q_abs:
//   - a producer warpgroup loads an item's q_abs once the previous item's scores are all formed
//     (under that item's last products and its output's stores), then gathers the latent rows
//     (cp.async completing on mbarriers) into four 32-key tiles, two stages of one tile per
//     consumer warpgroup: the next stage's rows are gathered while the present stage is
//     multiplied, across items too;
//   - keys go 64 at a time: warpgroup w scores its own block of 32 (S_w = q_abs · L_wᵀ,
//     m64n32k16 × 32);
//   - the row maxima of both blocks meet in shared memory, then warpgroup w adds to its output
//     columns 256w .. 256w+255 the product of its own P, kept in registers, with its block
//     (m64n256k16 with A from registers), and of the other warpgroup's P, read from shared memory,
//     with the other block; the output is rescaled only when a row's maximum moved;
//   - the next stage's scores are issued before both products are waited for, and a stage's tiles
//     go back to the producer once both products have read them.
// The stages and their barriers' phases count iterations over all of a block's items. Shared
// memory: q_abs (64 KB), four key tiles (128 KB), P of both warpgroups for two iterations
// (32 KB), row maxima and sums, ten mbarriers.

namespace absorbed_fwd {

using absorbed_tiles::kHeads;
using absorbed_tiles::kR;
constexpr int kKeys = 32;  // keys per warpgroup and stage
constexpr int kConsumerThreads = 256;
constexpr int kThreads = 384;
constexpr int kQPanelBytes = kHeads * 128;   // 64 heads of one 64-column panel
constexpr int kKeyPanelBytes = kKeys * 128;  // 32 keys of one 64-column panel
constexpr int kQBytes = 8 * kQPanelBytes;
constexpr int kTileBytes = 8 * kKeyPanelBytes;  // 32 keys × 512 columns
constexpr int kHalfBytes = 4 * kKeyPanelBytes;  // 256 columns of a tile
constexpr int kPBytes = kQPanelBytes;           // P: 64 heads × 32 keys in a 128-byte panel
constexpr int kConsumerRegisters = 208;
constexpr int kProducerRegisters = 88;
static_assert(2 * 128 * kConsumerRegisters + 128 * kProducerRegisters <= 65536);
constexpr int kMaxBarrier = 1, kPBarrier = 2, kEpilogueBarrier = 3;

struct Barriers {
  uint64_t q_full;       // the item's q_abs landed
  uint64_t q_empty;      // every score product of the item has read q_abs
  uint64_t full[2][2];   // [stage][tile]: the producer's rows landed
  uint64_t empty[2][2];  // [stage][tile]: no product reads the tile any more
};
constexpr int kSmemBytes = kQBytes + 4 * kTileBytes + 4 * kPBytes + 2 * 2 * kHeads * 4 +
                           2 * kHeads * 4 + int(sizeof(Barriers)) + 1024;

}  // namespace absorbed_fwd

// out[i, h] = Σ_j softmax_j(scale · q_abs[i,h] · latent[j]) latent[j]; lse2[i, h] = log2 Σ_j
// 2^(s_j) in base-2 units (+∞ and a zero output for a query without keys). Items (query, block of
// 64 heads) number T · ⌈NH/64⌉, query-major; any grid of (blocks, 1) covers them,
// absorbed_fwd::kThreads threads, absorbed_fwd::kSmemBytes of dynamic shared memory.
__global__ void __launch_bounds__(absorbed_fwd::kThreads, 1)
    absorbed_forward_wgmma_kernel(AbsorbedForwardArgs a, int64_t items,
                                  __nv_bfloat16* __restrict__ out, float* __restrict__ lse2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace absorbed_fwd;
  unsigned char* smem = absorbed_tiles::smem_1024();
  unsigned char* sQ = smem;
  unsigned char* sK = smem + kQBytes;                        // [stage][tile]
  unsigned char* sP = sK + 4 * kTileBytes;                   // [iteration parity][warpgroup]
  float* sMax = reinterpret_cast<float*>(sP + 4 * kPBytes);  // [parity][warpgroup][64 rows]
  float* sSum = sMax + 2 * 2 * kHeads;                       // [warpgroup][64 rows]
  Barriers* bars = reinterpret_cast<Barriers*>(sSum + 2 * kHeads);

  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x >> 7), 0);
  const int head_blocks = (a.heads + kHeads - 1) / kHeads;
  if (threadIdx.x == 0) {
    wgmma::mbarrier_init(&bars->q_full, 128);
    wgmma::mbarrier_init(&bars->q_empty, 256);
    for (int s = 0; s < 2; ++s)
      for (int t = 0; t < 2; ++t) {
        wgmma::mbarrier_init(&bars->full[s][t], 128);
        wgmma::mbarrier_init(&bars->empty[s][t], 256);  // both warpgroups' products read it
      }
    wgmma::mbarrier_init_fence();
  }
  __syncthreads();

  if (wg == 2) {
    wgmma::give_back_registers<kProducerRegisters>();
    const int p = threadIdx.x - 256, warp = p >> 5, lane = p & 31;
    int64_t jj = 0;  // iterations of the earlier items
    int n = 0;       // the block's items so far
    // This lane copies the 16-byte chunks `lane` and 32 + lane of rows warp + 4r: their places
    // in a tile less 512r bytes, for even and odd r (the swizzle of wgmma::swizzled: row warp +
    // 4r lies in the 8-row group at warp + 4·(r mod 2)), fixed for the whole kernel.
    const uint32_t tile0 = wgmma::smem_u32(sK);
    uint32_t dst_of[2][2];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int parity = 0; parity < 2; ++parity) {
        const int chunk = half * 32 + lane;
        dst_of[half][parity] =
            (chunk >> 3) * kKeyPanelBytes + warp * 128 + (((chunk & 7) ^ (warp + 4 * parity)) << 4);
      }
    const __nv_bfloat16* row_start = a.latent + lane * 8;
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x, ++n) {
      const int64_t i = item / head_blocks;
      const int h0 = int(item % head_blocks) * kHeads;
      const int count = a.counts[i];
      const int iterations = ((count + kKeys - 1) / kKeys + 1) / 2;
      const int32_t* key_row = a.keys + i * a.width;
      if (n > 0) wgmma::mbarrier_wait(&bars->q_empty, (n - 1) & 1);
#pragma unroll 4
      for (int e = p; e < kHeads * (kR / 8); e += 128) {
        const int row = e >> 6, chunk = e & 63;
        const bool valid = h0 + row < a.heads;
        tc::cp_async16_zfill(
            sQ + (chunk >> 3) * kQPanelBytes + wgmma::swizzled(row, (chunk & 7) * 8),
            valid ? a.q + (i * a.heads + h0 + row) * kR + chunk * 8 : a.q, valid);
      }
      wgmma::mbarrier_arrive_on_cp_async(&bars->q_full);
      for (int j = 0; j < iterations; ++j, ++jj) {
        const int s = int(jj & 1);
        // Lane l < 8 holds the position of tile 0's row warp + 4l, lanes 8 + l tile 1's.
        const int tile_of_lane = (lane >> 3) & 1, row_of_lane = warp + 4 * (lane & 7);
        const int slot = (2 * j + tile_of_lane) * kKeys + row_of_lane;
        const int32_t position = lane < 16 && slot < count ? key_row[slot] : -1;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          if (jj >= 2) wgmma::mbarrier_wait(&bars->empty[s][t], int(((jj >> 1) - 1) & 1));
          const uint32_t tile = tile0 + (2 * s + t) * kTileBytes;
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            // A row past the count copies zeros from row 0 (any readable address does).
            const int32_t pos = __shfl_sync(0xffffffffu, position, 8 * t + r);
            const __nv_bfloat16* src = row_start + uint32_t(max(pos, 0)) * uint64_t(kR);
#pragma unroll
            for (int half = 0; half < 2; ++half)
              tc::cp_async16_zfill(tile + dst_of[half][r & 1] + r * 4 * 128, src + half * 256,
                                   pos >= 0);
          }
          wgmma::mbarrier_arrive_on_cp_async(&bars->full[s][t]);
        }
      }
    }
    tc::cp_async_wait<0>();
    return;
  }

  wgmma::take_registers<kConsumerRegisters>();
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = warp * 16 + g;
  const int own = wg, other = 1 - wg;

  // This thread's values of its two rows into slots[own][row] ([2][64]), then the consumers'
  // barrier `id`, after which the other warpgroup's are readable.
  auto share_rows = [&](float* slots, const float(&v)[2], int id) {
    if (t == 0) {
      slots[own * kHeads + row0] = v[0];
      slots[own * kHeads + row0 + 8] = v[1];
    }
    wgmma::named_barrier<kConsumerThreads>(id);
  };

  // Every operand's descriptor advances from one of these by constants (wgmma::desc_advance).
  const uint64_t q_k = wgmma::desc_k_major(sQ), keys_k = wgmma::desc_k_major(sK);
  const uint64_t keys_mn = wgmma::desc_mn_major(sK, kKeyPanelBytes), p_k = wgmma::desc_k_major(sP);

  float s[16];
  // The scores of the block's iteration jj, counted over its items (jj names the stage and phase).
  auto issue_scores = [&](int64_t jj) {
    const uint64_t tile = wgmma::desc_advance(keys_k, (2 * int(jj & 1) + own) * kTileBytes);
    wgmma::mbarrier_wait(&bars->full[jj & 1][own], int((jj >> 1) & 1));
    wgmma::fence_shared_for_async();
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 32; ++kk) {
      const int panel = kk >> 2, k_bytes = (kk & 3) * 32;
      wgmma::mma_m64n32k16<0, 0>(s, wgmma::desc_advance(q_k, panel * kQPanelBytes + k_bytes),
                                 wgmma::desc_advance(tile, panel * kKeyPanelBytes + k_bytes),
                                 kk == 0);
    }
    wgmma::commit();
  };

  float o[128];
  int64_t jj0 = 0;  // iterations of the earlier items
  int n = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x, ++n) {
    const int64_t i = item / head_blocks;
    const int h0 = int(item % head_blocks) * kHeads;
    const int count = a.counts[i];
    const int blocks = (count + kKeys - 1) / kKeys;
    const int iterations = (blocks + 1) / 2;
#pragma unroll
    for (int e = 0; e < 128; ++e) o[e] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    // Every item's q_abs is waited for, keys or not: a wait skipped would let the next one name
    // a phase the barrier has not reached.
    wgmma::mbarrier_wait(&bars->q_full, n & 1);
    if (iterations > 0)
      issue_scores(jj0);
    else
      wgmma::mbarrier_arrive(&bars->q_empty);
    for (int j = 0; j < iterations; ++j) {
      const int64_t jj = jj0 + j;
      const int st = int(jj & 1);
      // The halves of the two tiles that this warpgroup's output columns read.
      const uint64_t own_half =
          wgmma::desc_advance(keys_mn, (2 * st + own) * kTileBytes + own * kHalfBytes);
      const uint64_t other_half =
          wgmma::desc_advance(keys_mn, (2 * st + other) * kTileBytes + own * kHalfBytes);
      wgmma::wait<0>();
      wgmma::pin(s);
      // The item's last scores are formed: its q_abs may make way for the next item's.
      if (j + 1 == iterations) wgmma::mbarrier_arrive(&bars->q_empty);

      const int block = 2 * j + own;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int slot = block * kKeys + (e >> 2) * 8 + 2 * t + (e & 1);
        s[e] = slot < count ? s[e] * a.scale_log2 : -INFINITY;
        mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[e]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      }
      float* max_slots = sMax + st * 2 * kHeads;
      share_rows(max_slots, mx, kMaxBarrier);
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float next = fmaxf(m[r], fmaxf(mx[r], max_slots[other * kHeads + row0 + 8 * r]));
        alpha[r] = exp2_ftz(m[r] - next);
        m[r] = next;
      }

      uint32_t pa[2][4];
      float sum[2] = {0.0f, 0.0f};
      unsigned char* own_p = sP + (st * 2 + own) * kPBytes;
#pragma unroll
      for (int e = 0; e < 16; e += 2) {
        const int r = (e >> 1) & 1;
        const float p0 = exp2_ftz(s[e] - m[r]), p1 = exp2_ftz(s[e + 1] - m[r]);
        sum[r] += p0 + p1;
        const __nv_bfloat162 pair = __floats2bfloat162_rn(p0, p1);
        pa[e >> 3][(e >> 1) & 3] = *reinterpret_cast<const uint32_t*>(&pair);
        *reinterpret_cast<__nv_bfloat162*>(
            own_p + wgmma::swizzled(row0 + 8 * r, (e >> 2) * 8 + 2 * t)) = pair;
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
        l[r] = l[r] * alpha[r] + sum[r];
      }
      if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
        for (int e = 0; e < 128; ++e) o[e] *= alpha[(e >> 1) & 1];
      }

      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma::mma_m64n256k16_rs<1>(o, pa[kk], wgmma::desc_advance(own_half, kk * 16 * 128), false);
      wgmma::commit();

      wgmma::fence_shared_for_async();
      wgmma::named_barrier<kConsumerThreads>(kPBarrier);
      const uint64_t other_p = wgmma::desc_advance(p_k, (st * 2 + other) * kPBytes);
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma::mma_m64n256k16<0, 1>(o, wgmma::desc_advance(other_p, kk * 32),
                                    wgmma::desc_advance(other_half, kk * 16 * 128), false);
      wgmma::commit();

      // The next stage's tiles were gathered during this one: score them under the products.
      if (j + 1 < iterations) {
        issue_scores(jj + 1);
        wgmma::wait<1>();
      } else {
        wgmma::wait<0>();
      }
      wgmma::pin(o);
      wgmma::mbarrier_arrive(&bars->empty[st][own]);
      wgmma::mbarrier_arrive(&bars->empty[st][other]);
    }
    jj0 += iterations;

    share_rows(sSum, l, kEpilogueBarrier);
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float total = sSum[row0 + 8 * r] + sSum[kHeads + row0 + 8 * r];
      inv[r] = blocks > 0 ? 1.0f / total : 0.0f;
      const int h = h0 + row0 + 8 * r;
      if (own == 0 && t == 0 && h < a.heads)
        lse2[i * a.heads + h] = blocks > 0 ? m[r] + log2f(total) : INFINITY;
    }
    // The sums are read: the next item (with no iteration, no other barrier) may write them.
    wgmma::named_barrier<kConsumerThreads>(kEpilogueBarrier);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = h0 + row0 + 8 * r;
      if (h >= a.heads) continue;
      __nv_bfloat16* dst = out + (i * a.heads + h) * kR + own * 256 + 2 * t;
#pragma unroll
      for (int c = 0; c < 32; ++c)
        *reinterpret_cast<__nv_bfloat162*>(dst + c * 8) =
            __floats2bfloat162_rn(o[4 * c + 2 * r] * inv[r], o[4 * c + 2 * r + 1] * inv[r]);
    }
  }
#endif
}

// ---- backward ----------------------------------------------------------------------------------
//
// One block per query (at most 64 heads), the query's selected keys 32 at a time. With
// P = 2^(s − lse2), dP = d o_lat · L and dS = scale · P (dP − delta), per block of keys:
//   scores  warpgroup 0: S = q_abs · Lᵀ; warpgroup 1: dP = d o_lat · Lᵀ  (m64n32k16 × 32 each)
//   P, dS   warpgroup 0 writes P (fp32 for warpgroup 1, bf16 key-major for the products),
//           warpgroup 1 then dS (bf16 key-major)
//   d q     warpgroup w: dQ_w += dS · L[32 keys, columns 256w ..]   (m64n256k16 × 2, kept in
//           registers over all the blocks)
//   d L     warpgroup w, columns c of 256w .. in 64-column tiles: d Lᵀ[c, key] = Σ_h d o_lat[h, c]
//           P[h, key] + q_abs[h, c] dS[h, key]  (m64n32k16 × 8 a tile, d o_lat and q_abs read
//           column-major), stored as bf16 rows of the (query, key) pairs' workspace
// so S and dP are formed once for both gradients, and every operand is read from the 128-byte-
// swizzled panels the forward uses (ops/cuda/wgmma.cuh): the key-major P and dS serve as K-major
// B (d L) and as column-major A (d q).

struct AbsorbedBackwardArgs {
  AbsorbedForwardArgs a;
  const __nv_bfloat16* dout;  // [T, NH, 512] d o_lat
  const float* lse2;          // [T, NH] from the forward
  const float* delta;         // [T, NH] d o_lat · o_lat
  float scale;                // the softmax scale (dS carries it)
  int64_t q0;                 // query of blockIdx.x = 0
};

namespace absorbed_bwd {

using absorbed_tiles::kHeads;
using absorbed_tiles::kR;
using absorbed_tiles::kThreads;
constexpr int kKeys = 32;
constexpr int kHeadPanelBytes = kHeads * 128;  // one 64-column panel of 64 rows
constexpr int kKeyPanelBytes = kKeys * 128;    // of 32 rows
constexpr int kHeadTileBytes = 8 * kHeadPanelBytes;
constexpr int kKeyTileBytes = 8 * kKeyPanelBytes;
constexpr int kKeyMajorBytes = kKeys * 128;  // P or dS as 32 key rows × 64 heads
// Each warpgroup's two d Lᵀ tiles as key rows of 64 bf16 columns, for 16-byte stores.
constexpr int kStageBytes = 2 * kKeys * 128;
// q_abs, d o_lat, two key tiles, P and dS key-major, P in fp32, the key positions of two blocks,
// both warpgroups' staged d L tiles, and room to align to 1024.
constexpr int kSmemBytes = 2 * kHeadTileBytes + 2 * kKeyTileBytes + 2 * kKeyMajorBytes +
                           kHeads * kKeys * 4 + 2 * kKeys * 4 + 2 * kStageBytes + 1024;

// Byte offset of (key, column) in a staged tile: 128-byte key rows whose 16-byte chunks are XORed
// by the key, so the accumulator's four keys a store touches fall in different banks.
__device__ __forceinline__ int stage_offset(int key, int column) {
  return key * 128 + ((((column >> 3) ^ key) & 7) << 4) + (column & 7) * 2;
}

// Barrier of one warpgroup (ids 3 and 4; the block's own barriers use 0 to 2).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(3 + wg) : "memory");
}

// fp32 P [64 heads][32 keys]: keys XORed by the row so a warp's float2 stores spread over banks.
__device__ __forceinline__ int p_slot(int row, int key) {
  return row * kKeys + (key ^ ((row & 3) << 3));
}

}  // namespace absorbed_bwd

// d q_abs[i] = scale Σ_j dS_j latent[j] (bf16 [T, NH, 512], queries q0 + blockIdx.x) and each
// (query, key) pair's share of d latent, Σ_h P d o_lat[i,h] + dS q_abs[i,h], as bf16 rows
// part[(i − q0) · width + slot] for the key-major reduction. Grid (queries), 256 threads,
// absorbed_bwd::kSmemBytes of dynamic shared memory.
__global__ void __launch_bounds__(absorbed_tiles::kThreads, 1)
    absorbed_backward_wgmma_kernel(AbsorbedBackwardArgs k, __nv_bfloat16* __restrict__ dq,
                                   __nv_bfloat16* __restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace absorbed_bwd;
  using absorbed_tiles::block_barrier;
  using absorbed_tiles::load_keys;
  using absorbed_tiles::load_rows;
  using absorbed_tiles::prefetch_position;
  unsigned char* smem = absorbed_tiles::smem_1024();
  unsigned char* sQ = smem;
  unsigned char* sD = smem + kHeadTileBytes;
  unsigned char* sK = smem + 2 * kHeadTileBytes;  // two tiles
  unsigned char* sPt = sK + 2 * kKeyTileBytes;    // P, key-major
  unsigned char* sSt = sPt + kKeyMajorBytes;      // dS, key-major
  float* sPf = reinterpret_cast<float*>(sSt + kKeyMajorBytes);
  int32_t* sPos = reinterpret_cast<int32_t*>(sPf + kHeads * kKeys);  // [2][kKeys], block b at b & 1

  const AbsorbedForwardArgs& a = k.a;
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x >> 7), 0);
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  // This warpgroup's staged d L tiles.
  unsigned char* sStage = reinterpret_cast<unsigned char*>(sPos + 2 * kKeys) + wg * kStageBytes;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = warp * 16 + g;  // this thread's accumulator rows: row0 and row0 + 8
  // A 64 × 32 accumulator (rows: this warpgroup's 64 heads or latent columns, columns: keys) into
  // a key-major tile at `tile` (128-byte rows, 16-byte chunks XORed by the key, as
  // wgmma::swizzled and stage_offset lay them out), transposed by stmatrix: store q takes keys
  // 16q .. 16q + 15, its matrix i the 8 × 8 block of keys 16q + 8·(i/2) .. and rows 16·warp +
  // 8·(i mod 2) .., whose key j lane 8i + j addresses (the swizzle of key 16q + x is that of x).
  const uint32_t transpose_lane =
      stage_offset(8 * ((lane >> 3) >> 1) + (lane & 7), 16 * warp + 8 * ((lane >> 3) & 1));
  const auto store_key_major = [&](uint32_t tile, const float(&v)[16]) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint32_t packed[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int e = 4 * (2 * q + (m >> 1)) + 2 * (m & 1);
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[e], v[e + 1]);
        packed[m] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      wgmma::stsm_x4_trans(tile + transpose_lane + q * 16 * 128, packed);
    }
  };
  const int64_t i = k.q0 + blockIdx.x;
  const int count = a.counts[i];
  const int blocks = (count + kKeys - 1) / kKeys;
  // Padded heads get lse2 = +∞, hence P = dS = 0.
  float lse[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = row0 + 8 * r;
    lse[r] = h < a.heads ? k.lse2[i * a.heads + h] : INFINITY;
    dlt[r] = h < a.heads ? k.delta[i * a.heads + h] : 0.0f;
  }

  const auto head_rows = [&](const __nv_bfloat16* base) {
    return [=](int r) -> const __nv_bfloat16* {
      return r < a.heads ? base + (i * a.heads + r) * kR : nullptr;
    };
  };
  load_rows(sQ, a.q, head_rows(a.q));
  load_rows(sD, k.dout, head_rows(k.dout));
  const int32_t* key_row = a.keys + i * a.width;
  absorbed_tiles::stage_first_positions<kKeys>(key_row, count, sPos);
  __syncthreads();
  if (blocks > 0) load_keys<kKeys>(a.latent, sK, sPos, 0, count);
  tc::cp_async_commit();

  float dqa[128];
#pragma unroll
  for (int e = 0; e < 128; ++e) dqa[e] = 0.0f;

  // Every operand's descriptor advances from one of these by constants (wgmma::desc_advance).
  const uint64_t score_a = wgmma::desc_k_major(wg == 0 ? sQ : sD);
  const uint64_t keys_k = wgmma::desc_k_major(sK),
                 keys_mn = wgmma::desc_mn_major(sK, kKeyPanelBytes);
  const uint64_t ds_mn = wgmma::desc_mn_major(sSt, kKeyMajorBytes);
  const uint64_t p_k = wgmma::desc_k_major(sPt), ds_k = wgmma::desc_k_major(sSt);
  const uint64_t dout_mn = wgmma::desc_mn_major(sD, kHeadPanelBytes);
  const uint64_t q_mn = wgmma::desc_mn_major(sQ, kHeadPanelBytes);

  for (int b = 0; b < blocks; ++b) {
    tc::cp_async_wait<0>();
    wgmma::fence_shared_for_async();
    __syncthreads();  // block b landed; the previous block's products are done with its tiles
    const uint32_t tile_bytes = (b & 1) * kKeyTileBytes;  // of block b's key tile
    const uint64_t tile_k = wgmma::desc_advance(keys_k, tile_bytes);
    const uint64_t tile_mn = wgmma::desc_advance(keys_mn, tile_bytes);
    const int32_t next_position = prefetch_position<kKeys>(key_row, b + 2, count);

    // Warpgroup 0: S; warpgroup 1: dP (64 heads × 32 keys over the 512 columns).
    float s[16];
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kR / 16; ++kk) {
      const int panel = kk >> 2, k_bytes = (kk & 3) * 32;
      wgmma::mma_m64n32k16<0, 0>(s, wgmma::desc_advance(score_a, panel * kHeadPanelBytes + k_bytes),
                                 wgmma::desc_advance(tile_k, panel * kKeyPanelBytes + k_bytes),
                                 kk == 0);
    }
    wgmma::commit();
    // Block b + 1's rows are requested while S and dP run.
    if (b + 1 < blocks)
      load_keys<kKeys>(a.latent, sK + ((b + 1) & 1) * kKeyTileBytes, sPos + ((b + 1) & 1) * kKeys,
                       b + 1, count);
    tc::cp_async_commit();
    wgmma::wait<0>();
    wgmma::pin(s);

    // Accumulator element e: head row0 + 8·((e/2) mod 2), key 8·(e/4) + 2t + (e mod 2).
    if (wg == 0) {
      float p[16];
#pragma unroll
      for (int e = 0; e < 16; e += 2) {
        const int r = (e >> 1) & 1, row = row0 + 8 * r, key = (e >> 2) * 8 + 2 * t;
        const int slot = b * kKeys + key;
        p[e] = slot < count ? exp2_ftz(s[e] * a.scale_log2 - lse[r]) : 0.0f;
        p[e + 1] = slot + 1 < count ? exp2_ftz(s[e + 1] * a.scale_log2 - lse[r]) : 0.0f;
        *reinterpret_cast<float2*>(sPf + p_slot(row, key)) = make_float2(p[e], p[e + 1]);
      }
      store_key_major(wgmma::smem_u32(sPt), p);
    }
    block_barrier(1);  // P in fp32 written
    if (wg == 1) {
      float ds[16];
#pragma unroll
      for (int e = 0; e < 16; e += 2) {
        const int r = (e >> 1) & 1, row = row0 + 8 * r, key = (e >> 2) * 8 + 2 * t;
        const float2 p = *reinterpret_cast<const float2*>(sPf + p_slot(row, key));
        ds[e] = k.scale * p.x * (s[e] - dlt[r]);
        ds[e + 1] = k.scale * p.y * (s[e + 1] - dlt[r]);
      }
      store_key_major(wgmma::smem_u32(sSt), ds);
    }
    wgmma::fence_shared_for_async();
    block_barrier(2);  // P and dS key-major complete

    // d q: A = dS read column-major from its key-major rows, B = the keys' columns 256·wg ...
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      wgmma::mma_m64n256k16<1, 1>(
          dqa, wgmma::desc_advance(ds_mn, kk * 16 * 128),
          wgmma::desc_advance(tile_mn, wg * 4 * kKeyPanelBytes + kk * 16 * 128), false);
    wgmma::commit();

    // d Lᵀ for this warpgroup's four 64-column tiles, two at a time: A = d o_lat or q_abs read
    // column-major (M = latent columns, K = heads), B = P or dS key-major (N = keys, K = heads).
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      float dl[2][16];
      wgmma::fence();
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int panel = wg * 4 + pair * 2 + m;
#pragma unroll
        for (int kk = 0; kk < kHeads / 16; ++kk)
          wgmma::mma_m64n32k16<1, 0>(
              dl[m], wgmma::desc_advance(dout_mn, panel * kHeadPanelBytes + kk * 16 * 128),
              wgmma::desc_advance(p_k, kk * 32), kk == 0);
#pragma unroll
        for (int kk = 0; kk < kHeads / 16; ++kk)
          wgmma::mma_m64n32k16<1, 0>(
              dl[m], wgmma::desc_advance(q_mn, panel * kHeadPanelBytes + kk * 16 * 128),
              wgmma::desc_advance(ds_k, kk * 32), false);
      }
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::pin(dl[0]);
      wgmma::pin(dl[1]);
      // Element e of tile m: latent column 64·panel + row0 + 8·((e/2) mod 2), key 8·(e/4) + 2t +
      // (e mod 2). Written key-major through shared memory (store_key_major), so each workspace
      // row takes whole 16-byte runs instead of one bf16 per store.
      warpgroup_barrier(wg);  // the previous pair's stores have read the stage
#pragma unroll
      for (int m = 0; m < 2; ++m) store_key_major(wgmma::smem_u32(sStage) + m * kKeys * 128, dl[m]);
      warpgroup_barrier(wg);
#pragma unroll
      for (int c = threadIdx.x & 127; c < 2 * kKeys * 8; c += 128) {
        const int m = c >> 8, key = (c >> 3) & (kKeys - 1), chunk = c & 7;
        const int slot = b * kKeys + key;
        if (slot < count)
          *reinterpret_cast<uint4*>(part + ((i - k.q0) * a.width + slot) * kR +
                                    (wg * 4 + pair * 2 + m) * 64 + chunk * 8) =
              *reinterpret_cast<const uint4*>(sStage + m * kKeys * 128 +
                                              stage_offset(key, chunk * 8));
      }
    }
    // Block b's positions are spent: block b + 2's take their place for the next step.
    if (threadIdx.x < kKeys) sPos[(b & 1) * kKeys + threadIdx.x] = next_position;
    wgmma::pin(dqa);
  }
  tc::cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = row0 + 8 * r;
    if (h >= a.heads) continue;
    __nv_bfloat16* dst = dq + (i * a.heads + h) * kR + wg * 256 + 2 * t;
#pragma unroll
    for (int n = 0; n < 32; ++n)
      *reinterpret_cast<__nv_bfloat162*>(dst + n * 8) =
          __floats2bfloat162_rn(dqa[4 * n + 2 * r], dqa[4 * n + 2 * r + 1]);
  }
#endif
}

}  // namespace glmtune::cuda::sm90

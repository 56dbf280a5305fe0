#pragma once
// The sparse absorbed-latent attention forward on Hopper's warpgroup MMA (ops/cuda/mla.h).
//
// One block per (query, 64 heads), two warpgroups, the query's selected latent rows taken 64 at a
// time (gathered with cp.async, double-buffered). Per block of 64 keys:
//   scores  warpgroup w: S_w = q_abs[64 × 512] · L[keys 32w .. 32w+31]ᵀ   (wgmma m64n32k16 × 32)
//   softmax the row maxima of both halves meet in shared memory; P (bf16, 64 × 64) is written
//           there for both warpgroups
//   output  warpgroup w: O_w = α O_w + P · L[64 keys, columns 256w .. 256w+255]  (m64n256k16 × 4)
// so each latent row is read once per query for both products, the scores are split by keys (no
// partial sums to exchange) and the fp32 output (64 × 512) is split by columns, 128 registers a
// thread. All operands sit in 128-byte-swizzled panels (ops/cuda/wgmma.cuh).

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

namespace absorbed_fwd {

constexpr int kR = 512;
constexpr int kHeads = 64;
constexpr int kKeys = 64;  // keys per block
constexpr int kThreads = 256;
constexpr int kPanels = kR / 64;
constexpr int kPanelBytes = 64 * 128;              // 64 rows of one 64-column panel
constexpr int kTileBytes = kPanels * kPanelBytes;  // 64 rows × 512 columns
constexpr int kPBytes = kPanelBytes;               // P: 64 heads × 64 keys
// q_abs, two key tiles, P, row maxima and sums of both warpgroups, and room to align to 1024.
constexpr int kSmemBytes = 3 * kTileBytes + kPBytes + 4 * kHeads * 4 + 1024;

// Barrier of the whole block under another id than __syncthreads.
__device__ __forceinline__ void block_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// 64 rows of 512 bf16 into a swizzled tile: row r from src(r), zeros where src(r) is null (a
// zero-filled copy still names a readable address, `fallback`).
template <typename Src>
__device__ __forceinline__ void load_rows(unsigned char* tile, const __nv_bfloat16* fallback,
                                          Src src) {
#pragma unroll 4
  for (int e = threadIdx.x; e < 64 * (kR / 8); e += kThreads) {
    const int row = e >> 6, chunk = e & 63;
    const __nv_bfloat16* p = src(row);
    unsigned char* dst = tile + (chunk >> 3) * kPanelBytes + wgmma::swizzled(row, (chunk & 7) * 8);
    tc::cp_async16_zfill(dst, p ? p + chunk * 8 : fallback, p != nullptr);
  }
}

__device__ __forceinline__ void load_keys(const AbsorbedForwardArgs& a, unsigned char* tile,
                                          int64_t i, int block, int count) {
  const int32_t* row = a.keys + i * a.width;
  load_rows(tile, a.latent, [&](int r) -> const __nv_bfloat16* {
    const int slot = block * kKeys + r;
    return slot < count ? a.latent + int64_t(row[slot]) * kR : nullptr;
  });
}

}  // namespace absorbed_fwd

// out[i, h] = Σ_j softmax_j(scale · q_abs[i,h] · latent[j]) latent[j]; lse2[i, h] = log2 Σ_j
// 2^(s_j) in base-2 units (+∞ and a zero output for a query without keys). Grid (T, ⌈NH/64⌉),
// 256 threads, absorbed_fwd::kSmemBytes of dynamic shared memory.
__global__ void __launch_bounds__(absorbed_fwd::kThreads, 1)
    absorbed_forward_wgmma_kernel(AbsorbedForwardArgs a, __nv_bfloat16* __restrict__ out,
                                  float* __restrict__ lse2) {
  // wgmma exists in sm_90a code only; other targets of a multi-architecture build get an empty
  // kernel that absorbed_forward_wgmma_available() never lets run.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace absorbed_fwd;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sQ = smem;
  unsigned char* sK = smem + kTileBytes;  // two tiles
  unsigned char* sP = smem + 3 * kTileBytes;
  float* sMax = reinterpret_cast<float*>(sP + kPBytes);  // [2 warpgroups][64 rows]
  float* sSum = sMax + 2 * kHeads;

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = warp * 16 + g;  // this thread's rows: row0 and row0 + 8
  const int64_t i = blockIdx.x;
  const int h0 = blockIdx.y * kHeads;
  const int count = a.counts[i];
  const int blocks = (count + kKeys - 1) / kKeys;

  load_rows(sQ, a.q, [&](int r) -> const __nv_bfloat16* {
    return h0 + r < a.heads ? a.q + (i * a.heads + h0 + r) * kR : nullptr;
  });
  if (blocks > 0) load_keys(a, sK, i, 0, count);
  tc::cp_async_commit();

  float o[128];
#pragma unroll
  for (int e = 0; e < 128; ++e) o[e] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int b = 0; b < blocks; ++b) {
    tc::cp_async_wait<0>();
    wgmma::fence_shared_for_async();
    __syncthreads();  // block b landed; both warpgroups are done with block b − 1's tile and P
    if (b + 1 < blocks) load_keys(a, sK + ((b + 1) & 1) * kTileBytes, i, b + 1, count);
    tc::cp_async_commit();
    const unsigned char* L = sK + (b & 1) * kTileBytes;

    // Scores of this warpgroup's 32 keys.
    float s[16];
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kR / 16; ++kk) {
      const int panel = kk >> 2, k_bytes = (kk & 3) * 32;
      wgmma::mma_m64n32k16<0>(
          s, wgmma::desc_k_major(sQ + panel * kPanelBytes + k_bytes),
          wgmma::desc_k_major(L + panel * kPanelBytes + wg * 32 * 128 + k_bytes), kk == 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(s);

    // Row maxima over both halves; keys past the count score −∞.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int slot = b * kKeys + wg * 32 + (e >> 2) * 8 + 2 * t + (e & 1);
      s[e] = slot < count ? s[e] * a.scale_log2 : -INFINITY;
      mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[e]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    if (t == 0) {
      sMax[wg * kHeads + row0] = mx[0];
      sMax[wg * kHeads + row0 + 8] = mx[1];
    }
    block_barrier(1);
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float other = sMax[(1 - wg) * kHeads + row0 + 8 * r];
      // Both warpgroups compute the same maximum (max is exact in any order).
      const float next = fmaxf(m[r], fmaxf(mx[r], other));
      alpha[r] = exp2f(m[r] - next);
      m[r] = next;
    }

    // P = 2^(s − m) in bf16 for the output product; the row sums of this half in fp32.
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
      const int r = (e >> 1) & 1;
      const float p0 = exp2f(s[e] - m[r]), p1 = exp2f(s[e + 1] - m[r]);
      sum[r] += p0 + p1;
      const int row = row0 + 8 * r, key = wg * 32 + (e >> 2) * 8 + 2 * t;
      *reinterpret_cast<__nv_bfloat162*>(sP + wgmma::swizzled(row, key)) =
          __floats2bfloat162_rn(p0, p1);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
      l[r] = l[r] * alpha[r] + sum[r];
    }
#pragma unroll
    for (int e = 0; e < 128; ++e) o[e] *= alpha[(e >> 1) & 1];
    wgmma::fence_shared_for_async();
    block_barrier(2);  // P complete

    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      wgmma::mma_m64n256k16<1>(
          o, wgmma::desc_k_major(sP + kk * 32),
          wgmma::desc_mn_major(L + wg * 4 * kPanelBytes + kk * 16 * 128, kPanelBytes), false);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o);
  }
  tc::cp_async_wait<0>();

  // Each warpgroup summed its own keys' probabilities (under the same maxima): add the halves.
  if (t == 0) {
    sSum[wg * kHeads + row0] = l[0];
    sSum[wg * kHeads + row0 + 8] = l[1];
  }
  __syncthreads();
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // Half 0 first in both warpgroups, so both divide by the same sum.
    const float total = sSum[row0 + 8 * r] + sSum[kHeads + row0 + 8 * r];
    inv[r] = blocks > 0 ? 1.0f / total : 0.0f;
    const int h = h0 + row0 + 8 * r;
    if (wg == 0 && t == 0 && h < a.heads)
      lse2[i * a.heads + h] = blocks > 0 ? m[r] + log2f(total) : INFINITY;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + row0 + 8 * r;
    if (h >= a.heads) continue;
    __nv_bfloat16* dst = out + (i * a.heads + h) * kR + wg * 256 + 2 * t;
#pragma unroll
    for (int n = 0; n < 32; ++n)
      *reinterpret_cast<__nv_bfloat162*>(dst + n * 8) =
          __floats2bfloat162_rn(o[4 * n + 2 * r] * inv[r], o[4 * n + 2 * r + 1] * inv[r]);
  }
#endif
}

}  // namespace glmtune::cuda::sm90

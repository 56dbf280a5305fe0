// Sparse MLA attention in the absorbed-latent form on tensor cores (ops/cuda/mla.h): the
// mma.sync kernels below, and the launches of the wgmma forward and backward of
// mla_absorbed_sm90.cuh.
//
// All heads of a query attend over the same latent rows, so one block per (query, 64 heads)
// computes the [64 × R] · [R × 32] scores and the [64 × 32] · [32 × R] outputs of each block of
// 32 selected keys with mma.sync m16n8k16 (bf16 operands, fp32 accumulation), reading each latent
// row once per query. Eight warps: warp w owns heads 16·(w mod 4) .. +15 and latent columns
// 256·(w div 4) .. +255. A score is the sum of the two column halves' partial products, exchanged
// through shared memory (both warps of a pair add them in the same order, so both hold identical
// scores and run identical softmax updates). Operands live in shared memory with 16-byte chunks
// XOR-swizzled by row, so every ldmatrix phase touches eight distinct bank groups; latent blocks
// are double-buffered with cp.async.

#include <algorithm>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/mla.h"
#include "glmtune/ops/cuda/mla_absorbed_sm90.cuh"
#include "glmtune/ops/cuda/sm90a.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kR = 512;         // latent width (kv_lora_rank)
constexpr int kHeads = 64;      // heads per block (fewer are zero-padded)
constexpr int kBlockKeys = 32;  // keys per step
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kHalf = kR / 2;  // latent columns per warp in the score / output products
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory: [64 × R] tiles (q_abs, d o_lat), two [32 × R] latent buffers, and the score
// exchange (f32 [2 products][2 halves][64][32]).
constexpr int kTileBytes = kHeads * kR * 2;
constexpr int kKeyTileBytes = kBlockKeys * kR * 2;
constexpr int kExchangeFloats = kHeads * kBlockKeys;
constexpr int kForwardSmem = kTileBytes + 2 * kKeyTileBytes + 2 * kExchangeFloats * 4;
constexpr int kBackwardSmem = 2 * kTileBytes + 2 * kKeyTileBytes + 4 * kExchangeFloats * 4;
// P and scale·dS as bf16 [64 heads][kPStride], row padded so ldmatrix rows hit distinct banks.
constexpr int kPStride = kBlockKeys + 8;

// ---- primitives ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared; zero-filled when !valid (src is then never read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n"); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Element (row, col) of a swizzled [rows × R] tile; col is a multiple of 8 (one 16-byte chunk).
__device__ __forceinline__ const bf16* tile_at(const bf16* base, int row, int col) {
  return base + row * kR + ((((col >> 3) ^ (row & 7))) << 3);
}
__device__ __forceinline__ bf16* tile_at(bf16* base, int row, int col) {
  return base + row * kR + ((((col >> 3) ^ (row & 7))) << 3);
}

// Exchange slot of (row, key): rows are 32 floats (one bank cycle), so the key is XORed with the
// row to spread a warp's float2 stores over the banks.
__device__ __forceinline__ int xslot(int row, int key) {
  return row * 32 + (key ^ ((row & 3) << 3));
}

// A thread's place in the kernels' split: warp w owns heads row0 = 16·(w mod 4) .. +15 of the
// block and latent columns col0 = 256·(w div 4) .. +255 (half = w div 4); lane = 4g + t in the
// MMA fragments.
struct WarpPlace {
  int warp, lane, g, t, half, row0, col0;
};
__device__ __forceinline__ WarpPlace warp_place() {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = warp >> 2;
  return {warp, lane, lane >> 2, lane & 3, half, (warp & 3) * 16, half * kHalf};
}

// Copies ROWS rows of R bf16 (row r at src(r), or zeros where src(r) is null) into a swizzled
// tile. A zero-filled chunk still names a valid address (`fallback`), though none is read.
template <int ROWS, typename Src>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* fallback, Src src) {
  constexpr int chunks = ROWS * (kR / 8);
#pragma unroll
  for (int e = threadIdx.x; e < chunks; e += kThreads) {
    const int row = e / (kR / 8), c = e % (kR / 8);
    const bf16* p = src(row);
    cp_async16(tile_at(tile, row, c * 8), p ? p + c * 8 : fallback, p != nullptr);
  }
}

struct AbsorbedArgs {
  const bf16* q;       // [T, NH, R] q_abs
  const bf16* latent;  // [T, R]
  const int32_t* keys;
  const int32_t* counts;
  int64_t width;
  int heads;
  float scale_log2;  // softmax scale · log2(e): scores are kept in base-2 units
};

// Loads block `b` of query i's keys into `tile` (keys past the row's count become zero rows).
__device__ __forceinline__ void load_keys(const AbsorbedArgs& a, bf16* tile, int64_t i, int b,
                                          int count) {
  const int32_t* row = a.keys + i * a.width;
  load_tile<kBlockKeys>(tile, a.latent, [&](int r) -> const bf16* {
    const int slot = b * kBlockKeys + r;
    return slot < count ? a.latent + int64_t(row[slot]) * kR : nullptr;
  });
}

// Rows (heads) of a [T, NH, R] tensor for query i and heads h0 .. h0+63 (zeros past NH).
__device__ __forceinline__ void load_heads(bf16* tile, const bf16* base, int64_t i, int h0,
                                           int heads) {
  load_tile<kHeads>(tile, base, [&](int r) -> const bf16* {
    return h0 + r < heads ? base + (i * heads + h0 + r) * kR : nullptr;
  });
}

// Waits for key block b (buffer b mod 2) and, once every warp is past the barrier and so done
// with block b − 1's buffer, starts block b + 1 there. Returns block b's tile.
__device__ __forceinline__ const bf16* next_key_block(const AbsorbedArgs& a, bf16* sL, int64_t i,
                                                      int b, int blocks, int count) {
  cp_async_wait_all();
  __syncthreads();
  if (b + 1 < blocks) load_keys(a, sL + ((b + 1) & 1) * (kBlockKeys * kR), i, b + 1, count);
  cp_async_commit();
  return sL + (b & 1) * (kBlockKeys * kR);
}

// Row r (head row0 + g + 8r of the block) of a warp's [16 × 256] accumulators times mul, as bf16
// from o, this lane's first column of the row.
__device__ __forceinline__ void store_row(bf16* o, const float (&acc)[32][4], int r, float mul) {
#pragma unroll
  for (int n = 0; n < 32; ++n)
    *reinterpret_cast<__nv_bfloat162*>(o + n * 8) =
        __floats2bfloat162_rn(acc[n][2 * r] * mul, acc[n][2 * r + 1] * mul);
}

// acc[nt] (16 rows × 8 keys, 4 key tiles) += A[16 rows of `arow0`.., columns `col0` .. +255] ·
// L[32 keys, same columns]ᵀ, A and L swizzled tiles.
__device__ __forceinline__ void scores_half(float (&acc)[4][4], const bf16* A, int arow0,
                                            const bf16* L, int col0, int lane) {
  const int a_row = arow0 + (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kHalf / 16; ++kk) {
    const int c = col0 + kk * 16;
    uint32_t af[4];
    ldsm_x4(af, tile_at(A, a_row, c + a_col));
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t bf[4];
      ldsm_x4(bf, tile_at(L, np * 16 + b_row, c + b_col));
      mma(acc[2 * np], af, bf[0], bf[1]);
      mma(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[nt] (16 rows × 8 columns, 32 column tiles = columns col0 .. +255) += P[16 × 32 keys] ·
// L[32 keys, columns], P given as C fragments of the score product.
__device__ __forceinline__ void weighted_sum(float (&acc)[32][4], const float (&p)[4][4],
                                             const bf16* L, int col0, int lane) {
  const int b_row = (lane & 7) + ((lane >> 3) & 1) * 8, b_col = (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const uint32_t af[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]),
                            pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                            pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                            pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < kHalf / 16; ++np) {
      uint32_t bf[4];
      ldsm_x4_t(bf, tile_at(L, kk * 16 + b_row, col0 + np * 16 + b_col));
      mma(acc[2 * np], af, bf[0], bf[1]);
      mma(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// Publishes this warp's partial scores and, after the barrier, replaces them by the sum of both
// halves (half 0 first, whichever warp adds).
__device__ __forceinline__ void store_partial(float* xch, const float (&s)[4][4], int row0,
                                              int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int key = nt * 8 + 2 * t;
    *reinterpret_cast<float2*>(xch + xslot(row0 + g, key)) = make_float2(s[nt][0], s[nt][1]);
    *reinterpret_cast<float2*>(xch + xslot(row0 + g + 8, key)) = make_float2(s[nt][2], s[nt][3]);
  }
}
__device__ __forceinline__ void load_sum(const float* x0, const float* x1, float (&s)[4][4],
                                         int row0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int key = nt * 8 + 2 * t;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int slot = xslot(row0 + g + 8 * hh, key);
      const float2 a = *reinterpret_cast<const float2*>(x0 + slot);
      const float2 b = *reinterpret_cast<const float2*>(x1 + slot);
      s[nt][2 * hh] = a.x + b.x;
      s[nt][2 * hh + 1] = a.y + b.y;
    }
  }
}

// ---- forward ---------------------------------------------------------------------------------

// o_lat[i, h] = Σ_j softmax_j(scale · q_abs[i,h]·latent[j]) latent[j]; lse2 = log2 Σ_j 2^(s_j),
// s in base-2 units (+∞ for a row without keys, whose output is 0).
__global__ void __launch_bounds__(kThreads, 1)
    absorbed_forward_kernel(AbsorbedArgs a, bf16* __restrict__ out, float* __restrict__ lse2) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sL = reinterpret_cast<bf16*>(smem + kTileBytes);
  float* sX = reinterpret_cast<float*>(smem + kTileBytes + 2 * kKeyTileBytes);
  const auto [warp, lane, g, t, half, row0, col0] = warp_place();
  const int64_t i = blockIdx.x;
  const int h0 = blockIdx.y * kHeads;
  const int count = a.counts[i];
  const int blocks = (count + kBlockKeys - 1) / kBlockKeys;

  load_heads(sQ, a.q, i, h0, a.heads);
  if (blocks > 0) load_keys(a, sL, i, 0, count);
  cp_async_commit();

  float acc[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int b = 0; b < blocks; ++b) {
    const bf16* L = next_key_block(a, sL, i, b, blocks, count);

    float s[4][4] = {};
    scores_half(s, sQ, row0, L, col0, lane);
    store_partial(sX + half * kExchangeFloats, s, row0, lane);
    __syncthreads();
    load_sum(sX, sX + kExchangeFloats, s, row0, lane);

    // Online softmax in base 2; keys past the count score −∞.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int slot = b * kBlockKeys + nt * 8 + 2 * t + (e & 1);
        s[nt][e] = slot < count ? s[nt][e] * a.scale_log2 : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) alpha[r] = exp2f(m[r] - mx[r]);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(s[nt][e] - mx[e >> 1]);
        sum[e >> 1] += s[nt][e];
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] = l[r] * alpha[r] + sum[r];
      m[r] = mx[r];
    }
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
    weighted_sum(acc, s, L, col0, lane);
  }
  cp_async_wait_all();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const float inv[2] = {blocks > 0 ? 1.0f / l[0] : 0.0f, blocks > 0 ? 1.0f / l[1] : 0.0f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + row0 + g + 8 * r;
    if (h >= a.heads) continue;
    store_row(out + (i * a.heads + h) * kR + col0 + 2 * t, acc, r, inv[r]);
    if (half == 0 && t == 0) lse2[i * a.heads + h] = blocks > 0 ? m[r] + log2f(l[r]) : INFINITY;
  }
}

// ---- backward --------------------------------------------------------------------------------

struct AbsorbedBackwardArgs {
  AbsorbedArgs a;
  const bf16* dout;    // [T, NH, R] d o_lat
  const float* lse2;   // [T, NH]
  const float* delta;  // [T, NH] d o_lat · o_lat
  float scale;
};

// delta[i, h] = Σ_c dout[i,h,c] · out[i,h,c] (fp32), one warp per row.
__global__ void delta_kernel(const bf16* __restrict__ out, const bf16* __restrict__ dout,
                             int64_t rows, float* __restrict__ delta) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kR / 256; ++c) {
    float x[8], y[8];
    detail::load_bf16x8(out + r * kR + c * 256 + lane * 8, x);
    detail::load_bf16x8(dout + r * kR + c * 256 + lane * 8, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) s += x[e] * y[e];
  }
  s = detail::warp_sum(s);
  if (lane == 0) delta[r] = s;
}

// The part both backward kernels share for one block of keys: probabilities p = 2^(s − lse2) and
// dS = p (dP − delta), dP = d o_lat · latent, for this warp's 16 heads × 32 keys (C fragments,
// identical in the two warps of a head group). Masked keys and padded heads get p = dS = 0.
__device__ __forceinline__ void probabilities(const AbsorbedBackwardArgs& k, const bf16* sQ,
                                              const bf16* sD, const bf16* L, float* sX, int b,
                                              int count, int row0, int col0, int half, int lane,
                                              const float (&lse)[2], const float (&dlt)[2],
                                              float (&p)[4][4], float (&ds)[4][4]) {
  const int t = lane & 3;
  float s[4][4] = {}, dp[4][4] = {};
  scores_half(s, sQ, row0, L, col0, lane);
  scores_half(dp, sD, row0, L, col0, lane);
  store_partial(sX + half * kExchangeFloats, s, row0, lane);
  store_partial(sX + (2 + half) * kExchangeFloats, dp, row0, lane);
  __syncthreads();
  load_sum(sX, sX + kExchangeFloats, s, row0, lane);
  load_sum(sX + 2 * kExchangeFloats, sX + 3 * kExchangeFloats, dp, row0, lane);
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int slot = b * kBlockKeys + nt * 8 + 2 * t + (e & 1);
      const float pr = slot < count ? exp2f(s[nt][e] * k.a.scale_log2 - lse[e >> 1]) : 0.0f;
      p[nt][e] = pr;
      ds[nt][e] = pr * (dp[nt][e] - dlt[e >> 1]);
    }
}

__device__ __forceinline__ void row_stats(const AbsorbedBackwardArgs& k, int64_t i, int h0,
                                          int row0, int lane, float (&lse)[2], float (&dlt)[2]) {
  const int g = lane >> 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + row0 + g + 8 * r;
    lse[r] = h < k.a.heads ? k.lse2[i * k.a.heads + h] : INFINITY;
    dlt[r] = h < k.a.heads ? k.delta[i * k.a.heads + h] : 0.0f;
  }
}

// How both backward kernels start on query i, heads h0 ..: the softmax statistics of the warp's
// rows, and the loads of q_abs, d o_lat and the first key block issued as one cp.async group.
__device__ __forceinline__ void start_backward(const AbsorbedBackwardArgs& k, bf16* sQ, bf16* sD,
                                               bf16* sL, int64_t i, int h0, int count, int blocks,
                                               int row0, int lane, float (&lse)[2],
                                               float (&dlt)[2]) {
  row_stats(k, i, h0, row0, lane, lse, dlt);
  load_heads(sQ, k.a.q, i, h0, k.a.heads);
  load_heads(sD, k.dout, i, h0, k.a.heads);
  if (blocks > 0) load_keys(k.a, sL, i, 0, count);
  cp_async_commit();
}

// d q_abs[i, h] = scale Σ_j dS_j latent[j], query-major (same split as the forward).
__global__ void __launch_bounds__(kThreads, 1)
    absorbed_dq_kernel(AbsorbedBackwardArgs k, bf16* __restrict__ dq) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sD = reinterpret_cast<bf16*>(smem + kTileBytes);
  bf16* sL = reinterpret_cast<bf16*>(smem + 2 * kTileBytes);
  float* sX = reinterpret_cast<float*>(smem + 2 * kTileBytes + 2 * kKeyTileBytes);
  const AbsorbedArgs& a = k.a;
  const auto [warp, lane, g, t, half, row0, col0] = warp_place();
  const int64_t i = blockIdx.x;
  const int h0 = blockIdx.y * kHeads;
  const int count = a.counts[i];
  const int blocks = (count + kBlockKeys - 1) / kBlockKeys;
  float lse[2], dlt[2];
  start_backward(k, sQ, sD, sL, i, h0, count, blocks, row0, lane, lse, dlt);

  float acc[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    const bf16* L = next_key_block(a, sL, i, b, blocks, count);
    float p[4][4], ds[4][4];
    probabilities(k, sQ, sD, L, sX, b, count, row0, col0, half, lane, lse, dlt, p, ds);
    weighted_sum(acc, ds, L, col0, lane);
  }
  cp_async_wait_all();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + row0 + g + 8 * r;
    if (h >= a.heads) continue;
    store_row(dq + (i * a.heads + h) * kR + col0 + 2 * t, acc, r, k.scale);
  }
}

// Each selected key's share of d latent from query i: Σ_h p[h,j] d o_lat[i,h] + scale dS[h,j]
// q_abs[i,h] ([32 keys × R] per block, an MMA over the 64 heads), written as bf16 rows
// part[(i − q0)·W + slot] for the key-major reduction. Queries q0 + blockIdx.x.
__global__ void __launch_bounds__(kThreads, 1)
    absorbed_dlatent_part_kernel(AbsorbedBackwardArgs k, int64_t q0, bf16* __restrict__ part) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sD = reinterpret_cast<bf16*>(smem + kTileBytes);
  bf16* sL = reinterpret_cast<bf16*>(smem + 2 * kTileBytes);
  float* sX = reinterpret_cast<float*>(smem + 2 * kTileBytes + 2 * kKeyTileBytes);
  // After the scores are summed the exchange area holds P and scale·dS (bf16 [64][kPStride]).
  bf16* sP = reinterpret_cast<bf16*>(sX);
  bf16* sS = sP + kHeads * kPStride;
  const AbsorbedArgs& a = k.a;
  const auto [warp, lane, g, t, half, row0, col0] = warp_place();
  // The key-side product: warp → keys 16·(w mod 2) .., columns 128·(w div 2) ..
  const int km = (warp & 1) * 16, kc = (warp >> 1) * 128;
  const int64_t i = q0 + blockIdx.x;
  const int h0 = blockIdx.y * kHeads;
  const int count = a.counts[i];
  const int blocks = (count + kBlockKeys - 1) / kBlockKeys;
  float lse[2], dlt[2];
  start_backward(k, sQ, sD, sL, i, h0, count, blocks, row0, lane, lse, dlt);

  for (int b = 0; b < blocks; ++b) {
    const bf16* L = next_key_block(a, sL, i, b, blocks, count);
    float p[4][4], ds[4][4];
    probabilities(k, sQ, sD, L, sX, b, count, row0, col0, half, lane, lse, dlt, p, ds);
    __syncthreads();  // every warp has read the exchange area
    if (half == 0) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int off = (row0 + g + 8 * r) * kPStride + nt * 8 + 2 * t;
          *reinterpret_cast<uint32_t*>(sP + off) = pack_bf16(p[nt][2 * r], p[nt][2 * r + 1]);
          *reinterpret_cast<uint32_t*>(sS + off) =
              pack_bf16(ds[nt][2 * r] * k.scale, ds[nt][2 * r + 1] * k.scale);
        }
    }
    __syncthreads();

    float acc[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const int a_row = (lane & 7) + (lane >> 4) * 8, a_col = km + ((lane >> 3) & 1) * 8;
    const int b_row = (lane & 7) + ((lane >> 3) & 1) * 8, b_col = (lane >> 4) * 8;
#pragma unroll
    for (int kh = 0; kh < kHeads / 16; ++kh) {
      uint32_t ap[4], as[4];
      ldsm_x4_t(ap, sP + (kh * 16 + a_row) * kPStride + a_col);
      ldsm_x4_t(as, sS + (kh * 16 + a_row) * kPStride + a_col);
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t bd[4], bq[4];
        ldsm_x4_t(bd, tile_at(sD, kh * 16 + b_row, kc + np * 16 + b_col));
        ldsm_x4_t(bq, tile_at(sQ, kh * 16 + b_row, kc + np * 16 + b_col));
        mma(acc[2 * np], ap, bd[0], bd[1]);
        mma(acc[2 * np + 1], ap, bd[2], bd[3]);
        mma(acc[2 * np], as, bq[0], bq[1]);
        mma(acc[2 * np + 1], as, bq[2], bq[3]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int slot = b * kBlockKeys + km + g + 8 * r;
      if (slot >= count) continue;
      bf16* o = part + ((i - q0) * a.width + slot) * kR + kc + 2 * t;
#pragma unroll
      for (int n = 0; n < 16; ++n)
        *reinterpret_cast<__nv_bfloat162*>(o + n * 8) =
            __floats2bfloat162_rn(acc[n][2 * r], acc[n][2 * r + 1]);
    }
  }
  cp_async_wait_all();
}

// d latent[j] += Σ over the (query, slot) pairs of key j whose query lies in [q0, q1), in
// ascending query order: a fixed order, so reruns are bit-identical. One block per key, 64
// threads × 8 columns.
__global__ void __launch_bounds__(64)
    dlatent_reduce_kernel(const bf16* __restrict__ part, const int32_t* __restrict__ key_offsets,
                          const int32_t* __restrict__ key_pairs, int64_t width, int64_t q0,
                          int64_t q1, float* __restrict__ dlat) {
  const int64_t j = blockIdx.x;
  const int64_t lo_id = q0 * width, hi_id = q1 * width;
  // This chunk's pairs are a contiguous run of the key's ascending pair ids.
  int b0 = key_offsets[j], b1 = key_offsets[j + 1];
  {
    int lo = b0, hi = b1;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (key_pairs[mid] < lo_id)
        lo = mid + 1;
      else
        hi = mid;
    }
    b0 = lo;
  }
  const int col = threadIdx.x * 8;
  // Continuing from what earlier chunks left makes the sum one sequence over all of the key's
  // pairs, whatever the chunk size: results are bit-identical across workspace sizes too.
  float* d = dlat + j * kR + col;
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = d[e];
  int p = b0;
  for (; p < b1; p += 4) {
    int64_t id[4];
    bool ok[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      id[u] = p + u < b1 ? int64_t(key_pairs[p + u]) : hi_id;
      ok[u] = id[u] < hi_id;
    }
    float x[4][8];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (ok[u]) detail::load_bf16x8(part + (id[u] - lo_id) * kR + col, x[u]);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (ok[u])
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += x[u][e];
    if (!ok[3]) break;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) d[e] = acc[e];
}

void check_absorbed(const Tensor& q_abs, const Tensor& latent, const SparseKeySets& sets,
                    bool key_major, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(
      q_abs.defined() && q_abs.dim() == 3 && q_abs.size(2) == kR && q_abs.dtype() == DType::bf16 &&
          q_abs.is_contiguous() && q_abs.device().is_cuda() && latent.defined() &&
          latent.dim() == 2 && latent.size(0) == q_abs.size(0) && latent.size(1) == kR &&
          latent.dtype() == DType::bf16 && latent.is_contiguous() &&
          latent.device() == q_abs.device(),
      std::string(op) + ": q_abs must be bf16 [T, NH, 512] and latent bf16 [T, 512], got " +
          detail::describe(q_abs) + " and " + detail::describe(latent));
  const int64_t tokens = q_abs.size(0);
  GLMTUNE_CUDA_OP_REQUIRE(
      sets.keys.defined() && sets.keys.dim() == 2 && sets.keys.size(0) == tokens &&
          sets.counts.defined() && sets.counts.numel() == tokens,
      std::string(op) + ": key sets do not match " + std::to_string(tokens) + " queries");
  if (key_major)
    GLMTUNE_CUDA_OP_REQUIRE(sets.key_offsets.defined() && sets.key_pairs.defined() &&
                                sets.key_offsets.numel() == tokens + 1,
                            std::string(op) + ": the key sets lack the key-major pairs");
}

AbsorbedArgs absorbed_args(const Tensor& q_abs, const Tensor& latent, const SparseKeySets& sets,
                           double scale) {
  return AbsorbedArgs{static_cast<const bf16*>(q_abs.data_ptr()),
                      static_cast<const bf16*>(latent.data_ptr()),
                      sets.keys.data<int32_t>(),
                      sets.counts.data<int32_t>(),
                      sets.keys.size(1),
                      int(q_abs.size(1)),
                      float(scale * double(kLog2e))};
}

template <typename Kernel>
void allow_smem(Kernel kernel, int bytes) {
  GLMTUNE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// The same arguments as the sm90 kernels take them.
sm90::AbsorbedForwardArgs sm90_args(const AbsorbedArgs& a) {
  return {a.q, a.latent, a.keys, a.counts, a.width, a.heads, a.scale_log2};
}

// The per-pair shares go through a bounded workspace, a chunk of queries at a time; chunks are
// reduced in order, so the result does not depend on the chunk size's effect on scheduling.
int64_t workspace_queries(int64_t tokens, int64_t width, int64_t workspace_bytes) {
  return std::max<int64_t>(1, std::min(tokens, workspace_bytes / (width * kR * 2)));
}

void reduce_chunk(const Tensor& part, const SparseKeySets& sets, int64_t tokens, int64_t width,
                  int64_t q0, int64_t q1, cudaStream_t stream, Tensor& dlat) {
  dlatent_reduce_kernel<<<unsigned(tokens), 64, 0, stream>>>(
      static_cast<const bf16*>(part.data_ptr()), sets.key_offsets.data<int32_t>(),
      sets.key_pairs.data<int32_t>(), width, q0, q1, dlat.data<float>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

// One kernel per chunk forms d q_abs and the chunk's shares (mla_absorbed_sm90.cuh), then the
// reduction adds them, as the mma.sync path does.
void absorbed_backward_wgmma(const AbsorbedBackwardArgs& k, const SparseKeySets& sets,
                             cudaStream_t stream, int64_t workspace_bytes,
                             AbsorbedAttentionGrads& g) {
  namespace bwd = sm90::absorbed_bwd;
  const int64_t tokens = g.q_abs.size(0), width = k.a.width;
  bf16* dq = static_cast<bf16*>(g.q_abs.data_ptr());
  if (width == 0) {  // no keys anywhere: d q_abs = 0
    GLMTUNE_CUDA_CHECK(cudaMemsetAsync(dq, 0, g.q_abs.nbytes(), stream));
    return;
  }
  sm90::AbsorbedBackwardArgs w{sm90_args(k.a), k.dout, k.lse2, k.delta, k.scale, 0};
  allow_smem(sm90::absorbed_backward_wgmma_kernel, bwd::kSmemBytes);
  const int64_t chunk = workspace_queries(tokens, width, workspace_bytes);
  Tensor part = Tensor::empty({chunk * width * kR}, DType::bf16, g.q_abs.device());
  for (int64_t q0 = 0; q0 < tokens; q0 += chunk) {
    const int64_t q1 = std::min(tokens, q0 + chunk);
    w.q0 = q0;
    sm90::absorbed_backward_wgmma_kernel<<<unsigned(q1 - q0), bwd::kThreads, bwd::kSmemBytes,
                                           stream>>>(w, dq, static_cast<bf16*>(part.data_ptr()));
    GLMTUNE_CUDA_CHECK_LAUNCH();
    reduce_chunk(part, sets, tokens, width, q0, q1, stream, g.latent);
  }
}

}  // namespace

bool absorbed_wgmma_available(int device) { return detail::sm90a_kernels_available(device); }

AbsorbedAttentionOutput absorbed_attention_forward(const Tensor& q_abs, const Tensor& latent,
                                                   const SparseKeySets& sets, double scale,
                                                   cudaStream_t stream, AbsorbedKernel kernel) {
  const char* op = "cuda::absorbed_attention_forward";
  check_absorbed(q_abs, latent, sets, false, op);
  const int64_t tokens = q_abs.size(0), heads = q_abs.size(1);
  detail::DeviceGuard guard(q_abs.device().index);
  const bool use_wgmma = kernel == AbsorbedKernel::wgmma;
  GLMTUNE_CUDA_OP_REQUIRE(
      !use_wgmma || absorbed_wgmma_available(q_abs.device().index),
      std::string(op) + ": the wgmma kernel needs a build for sm_90a and a Hopper GPU");
  AbsorbedAttentionOutput r;
  r.out = Tensor::empty({tokens, heads, kR}, DType::bf16, q_abs.device());
  r.lse2 = Tensor::empty({tokens, heads}, DType::f32, q_abs.device());
  if (tokens == 0 || heads == 0) return r;
  const dim3 grid(unsigned(tokens), unsigned((heads + kHeads - 1) / kHeads));
  const AbsorbedArgs a = absorbed_args(q_abs, latent, sets, scale);
  if (use_wgmma) {
    namespace fwd = sm90::absorbed_fwd;
    allow_smem(sm90::absorbed_forward_wgmma_kernel, fwd::kSmemBytes);
    // Persistent blocks, one per SM: each loads its next query's q_abs under the present one's
    // last products and output stores.
    const int64_t items = int64_t(grid.x) * grid.y;
    int sms = 0;
    GLMTUNE_CUDA_CHECK(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q_abs.device().index));
    sm90::absorbed_forward_wgmma_kernel<<<unsigned(std::min<int64_t>(items, sms)), fwd::kThreads,
                                          fwd::kSmemBytes, stream>>>(
        sm90_args(a), items, static_cast<bf16*>(r.out.data_ptr()), r.lse2.data<float>());
  } else {
    allow_smem(absorbed_forward_kernel, kForwardSmem);
    absorbed_forward_kernel<<<grid, kThreads, kForwardSmem, stream>>>(
        a, static_cast<bf16*>(r.out.data_ptr()), r.lse2.data<float>());
  }
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return r;
}

AbsorbedAttentionGrads absorbed_attention_backward(const Tensor& q_abs, const Tensor& latent,
                                                   const Tensor& out, const Tensor& lse2,
                                                   const SparseKeySets& sets, double scale,
                                                   const Tensor& dout, cudaStream_t stream,
                                                   int64_t workspace_bytes, AbsorbedKernel kernel) {
  const char* op = "cuda::absorbed_attention_backward";
  check_absorbed(q_abs, latent, sets, true, op);
  const int64_t tokens = q_abs.size(0), heads = q_abs.size(1), width = sets.keys.size(1);
  GLMTUNE_CUDA_OP_REQUIRE(out.defined() && out.shape() == q_abs.shape() &&
                              out.dtype() == DType::bf16 && out.is_contiguous() && dout.defined() &&
                              dout.shape() == q_abs.shape() && dout.dtype() == DType::bf16 &&
                              dout.is_contiguous() && lse2.defined() &&
                              lse2.dtype() == DType::f32 && lse2.numel() == tokens * heads,
                          std::string(op) + ": out / dout must be bf16 like q_abs " + q_abs.str() +
                              " and lse2 f32 [T, NH]");
  // One block of heads per query: the per-pair shares of d latent sum over all heads in one block.
  GLMTUNE_CUDA_OP_REQUIRE(heads <= kHeads,
                          std::string(op) + ": at most 64 heads, got " + std::to_string(heads));
  const bool use_wgmma = kernel == AbsorbedKernel::wgmma;
  GLMTUNE_CUDA_OP_REQUIRE(
      !use_wgmma || absorbed_wgmma_available(q_abs.device().index),
      std::string(op) + ": the wgmma kernel needs a build for sm_90a and a Hopper GPU");
  const Device dev = q_abs.device();
  detail::DeviceGuard guard(dev.index);
  AbsorbedAttentionGrads g;
  g.q_abs = Tensor::empty(q_abs.shape(), DType::bf16, dev);
  g.latent = Tensor::zeros({tokens, kR}, DType::f32, dev);
  if (tokens == 0 || heads == 0) return g;
  Tensor delta = Tensor::empty({tokens, heads}, DType::f32, dev);
  delta_kernel<<<unsigned((tokens * heads + 7) / 8), 256, 0, stream>>>(
      static_cast<const bf16*>(out.data_ptr()), static_cast<const bf16*>(dout.data_ptr()),
      tokens * heads, delta.data<float>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  const AbsorbedBackwardArgs k{absorbed_args(q_abs, latent, sets, scale),
                               static_cast<const bf16*>(dout.data_ptr()), lse2.data<float>(),
                               delta.data<float>(), float(scale)};
  if (use_wgmma) {
    absorbed_backward_wgmma(k, sets, stream, workspace_bytes, g);
    return g;
  }
  const unsigned head_blocks = 1;
  allow_smem(absorbed_dq_kernel, kBackwardSmem);
  absorbed_dq_kernel<<<dim3(unsigned(tokens), head_blocks), kThreads, kBackwardSmem, stream>>>(
      k, static_cast<bf16*>(g.q_abs.data_ptr()));
  GLMTUNE_CUDA_CHECK_LAUNCH();
  if (width == 0) return g;

  const int64_t chunk = workspace_queries(tokens, width, workspace_bytes);
  Tensor part = Tensor::empty({chunk * width * kR}, DType::bf16, dev);
  allow_smem(absorbed_dlatent_part_kernel, kBackwardSmem);
  for (int64_t q0 = 0; q0 < tokens; q0 += chunk) {
    const int64_t q1 = std::min(tokens, q0 + chunk);
    absorbed_dlatent_part_kernel<<<dim3(unsigned(q1 - q0), head_blocks), kThreads, kBackwardSmem,
                                   stream>>>(k, q0, static_cast<bf16*>(part.data_ptr()));
    GLMTUNE_CUDA_CHECK_LAUNCH();
    reduce_chunk(part, sets, tokens, width, q0, q1, stream, g.latent);
  }
  return g;
}

}  // namespace glmtune::cuda

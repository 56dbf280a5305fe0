// Vision tower kernels (ops/cuda/vision.h): 2-D rotary embedding, exact GELU, and flash attention
// within the segments of a pack, forward and backward.

#include <algorithm>
#include <cmath>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/tensor_core.cuh"
#include "glmtune/ops/cuda/vision.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kThreads = 256;

// ---- rotary embedding ------------------------------------------------------------------------

// One thread per rotated pair (lo = x[m], hi = x[m + hd/2]) of x [N·H, hd]; `transpose` applies
// the rotation's transpose (the backward), with the CPU op's arithmetic.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(T* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
                int64_t pairs, int heads, int hd, bool transpose) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= pairs) return;
  const int half = hd / 2;
  const int64_t row = i / half;
  const int m = int(i % half);
  const int64_t pos = row / heads;
  const float* c = cos + pos * hd + m;
  const float* s = sin + pos * hd + m;
  T* p = x + row * hd + m;
  const float a = detail::to_f(p[0]), b = detail::to_f(p[half]);
  float lo, hi;
  if (transpose) {
    lo = a * c[0] + b * s[half];
    hi = b * c[half] - a * s[0];
  } else {
    lo = a * c[0] - b * s[0];
    hi = b * c[half] + a * s[half];
  }
  p[0] = detail::from_f<T>(lo);
  p[half] = detail::from_f<T>(hi);
}

// ---- exact GELU --------------------------------------------------------------------------------

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

template <typename T>
__global__ void __launch_bounds__(kThreads) gelu_kernel(T* __restrict__ x, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const float v = detail::to_f(x[i]);
  x[i] = detail::from_f<T>(0.5f * v * (1.0f + erff(v * kInvSqrt2)));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gelu_backward_kernel(const T* __restrict__ x, T* __restrict__ dy, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const float v = detail::to_f(x[i]);
  const float cdf = 0.5f * (1.0f + erff(v * kInvSqrt2));
  const float pdf = kInvSqrt2Pi * expf(-0.5f * v * v);
  dy[i] = detail::from_f<T>(detail::to_f(dy[i]) * (cdf + v * pdf));
}

// ---- attention ---------------------------------------------------------------------------------
//
// A block of W warps owns 16·W rows (queries in the forward and the dQ kernel, keys in the dK/dV
// kernel), 16 per warp, and streams the other side of the segment through shared memory 64 rows
// at a time, double-buffered (the next 64 rows load with cp.async while the MMAs run on these).
// The forward takes W = 8 (each staged key tile feeds twice the MMAs of W = 4: +16..19% on an
// H200); the backward kernels, at 170+ registers a thread, W = 4 (as fast or faster there).
// Tiles are [rows][D + 8] bf16: the 8-element pad puts the rows of every ldmatrix on distinct
// banks. Scores are kept in base-2 units (scale · log2 e folded in), so exp2 replaces exp.

constexpr int kForwardWarps = 8;
constexpr int kBackwardWarps = 4;
constexpr int kOtherRows = 64;  // rows of the other side per step
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

template <int D>
constexpr int kLd = D + 8;
template <int D, int W>
constexpr int kOwnElems = 16 * W* kLd<D>;
template <int D>
constexpr int kOtherElems = kOtherRows* kLd<D>;

// A unit of work: rows [row0, row_end) of the block's own side (at most 16·W of them are the
// block's), and the other side's rows [other0, other_end).
struct Tile {
  int32_t row0, row_end, other0, other_end;
};

// Stages rows [row0, row0 + ROWS) of a [rows, ·] matrix (columns from `base`, row stride ld) into
// a tile; rows at or past row_end become zeros.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void stage_rows(bf16* tile, const bf16* base, int64_t ld, int64_t row0,
                                           int64_t row_end) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int e = threadIdx.x; e < ROWS * kChunks; e += THREADS) {
    const int r = e / kChunks, c = e % kChunks;
    const bool valid = row0 + r < row_end;
    const bf16* src = valid ? base + (row0 + r) * ld + c * 8 : base;
    tc::cp_async16_zfill(tile + r * kLd<D> + c * 8, src, valid);
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// acc[16 × 64] += A[16 × D] · B[64 × D]ᵀ for this warp: A rows `a_row0..` of tile a, B all 64 rows
// of tile b (both [row][D], D contiguous).
template <int D>
__device__ __forceinline__ void product_abt(float (&acc)[8][4], const bf16* a, int a_row0,
                                            const bf16* b) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t fa[4];
    tc::ldsm_a_mk(a, kLd<D>, a_row0, kk * 16, fa);
#pragma unroll
    for (int nt = 0; nt < 8; nt += 2) {
      uint32_t b0[2], b1[2];
      tc::ldsm_b_nk(b, kLd<D>, nt * 8, kk * 16, b0, b1);
      tc::mma(acc[nt], fa, b0);
      tc::mma(acc[nt + 1], fa, b1);
    }
  }
}

// acc[16 × D] += P[16 × 64] · B[64 × D] with P in accumulator layout (rounded to bf16 here) and B
// all 64 rows of tile b.
template <int D>
__device__ __forceinline__ void product_pb(float (&acc)[D / 8][4], const float (&p)[8][4],
                                           const bf16* b) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t fa[4] = {
        pack_bf16(p[2 * j][0], p[2 * j][1]), pack_bf16(p[2 * j][2], p[2 * j][3]),
        pack_bf16(p[2 * j + 1][0], p[2 * j + 1][1]), pack_bf16(p[2 * j + 1][2], p[2 * j + 1][3])};
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t b0[2], b1[2];
      tc::ldsm_b_kn(b, kLd<D>, j * 16, np * 16, b0, b1);
      tc::mma(acc[2 * np], fa, b0);
      tc::mma(acc[2 * np + 1], fa, b1);
    }
  }
}

// Runs body(buf, row) for every kOtherRows-row block [row, ...) of [first, end), each staged into
// buffer `buf` by stage(buf, row) one block ahead (double-buffered); the caller has staged the
// first block into buffer 0 and committed it.
template <typename Stage, typename Body>
__device__ __forceinline__ void for_each_staged_block(int first, int end, Stage&& stage,
                                                      Body&& body) {
  int buf = 0;
  for (int row = first; row < end; row += kOtherRows, buf ^= 1) {
    tc::cp_async_wait<0>();
    __syncthreads();  // this buffer landed; every warp is done with the other one
    if (row + kOtherRows < end) {
      stage(buf ^ 1, row + kOtherRows);
      tc::cp_async_commit();
    }
    body(buf, row);
  }
}

struct AttnArgs {
  const Tile* tiles;
  const bf16* q;  // row r of the pack at q + (r - q_begin)·ldq
  const bf16* k;
  const bf16* v;
  const bf16* out;
  const bf16* dout;
  int64_t ldq, ldk, ldv, ldo;
  int64_t q_begin;
  int heads;
  float scale;       // softmax scale
  float scale_log2;  // scale · log2 e
};

// A block's unit of work (tile blockIdx.x at head blockIdx.y, whose columns start at col0) and
// the thread's place in its warp's fragments (rows g and g + 8, columns 2·tq and 2·tq + 1).
struct AttnThread {
  Tile t;
  int h, warp, g, tq;
  int64_t col0;
};
template <int D>
__device__ __forceinline__ AttnThread attn_thread(const AttnArgs& a) {
  const int h = blockIdx.y, lane = threadIdx.x % 32;
  return {a.tiles[blockIdx.x], h, int(threadIdx.x / 32), lane / 4, lane % 4, int64_t(h) * D};
}

// Stages key and value rows [kb, kb + 64) of head col0 / D (zeros from other_end on) into
// buffer buf: the other side of the forward and the dQ kernel, which stream the same rows.
template <int D, int W>
__device__ __forceinline__ void stage_keys_values(bf16* s_k, bf16* s_v, const AttnArgs& a,
                                                  int64_t col0, int other_end, int buf, int kb) {
  stage_rows<D, kOtherRows, 32 * W>(s_k + buf * kOtherElems<D>, a.k + col0, a.ldk, kb, other_end);
  stage_rows<D, kOtherRows, 32 * W>(s_v + buf * kOtherElems<D>, a.v + col0, a.ldv, kb, other_end);
}

// Forward: one block per (tile of 16·W query rows, head).
template <int D, int W>
__global__ void __launch_bounds__(32 * W)
    attn_forward_kernel(AttnArgs a, bf16* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_k = s_q + kOwnElems<D, W>;     // two buffers
  bf16* s_v = s_k + 2 * kOtherElems<D>;  // two buffers
  const auto [t, h, warp, g, tq, col0] = attn_thread<D>(a);
  auto stage_keys = [&](int buf, int kb) {
    stage_keys_values<D, W>(s_k, s_v, a, col0, t.other_end, buf, kb);
  };

  stage_rows<D, 16 * W, 32 * W>(s_q, a.q + col0, a.ldq, t.row0 - a.q_begin, t.row_end - a.q_begin);
  stage_keys(0, t.other0);
  tc::cp_async_commit();
  float o[D / 8][4] = {};
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  for_each_staged_block(t.other0, t.other_end, stage_keys, [&](int buf, int kb) {
    const bf16* keys = s_k + buf * kOtherElems<D>;
    const bf16* values = s_v + buf * kOtherElems<D>;

    float s[8][4] = {};
    product_abt<D>(s, s_q, warp * 16, keys);
    const int valid = t.other_end - kb;
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * tq + (e & 1);
        const float x = col < valid ? s[nt][e] * a.scale_log2 : -INFINITY;
        s[nt][e] = x;
        if (e < 2)
          mx0 = fmaxf(mx0, x);
        else
          mx1 = fmaxf(mx1, x);
      }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
    m0 = mx0;
    m1 = mx1;
    l0 *= c0;
    l1 *= c1;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= c0;
      o[n][1] *= c0;
      o[n][2] *= c1;
      o[n][3] *= c1;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - m0);
      s[nt][1] = exp2f(s[nt][1] - m0);
      s[nt][2] = exp2f(s[nt][2] - m1);
      s[nt][3] = exp2f(s[nt][3] - m1);
      l0 += s[nt][0] + s[nt][1];
      l1 += s[nt][2] + s[nt][3];
    }
    product_pb<D>(o, s, values);
  });
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const int64_t r0 = int64_t(t.row0) + warp * 16 + g, r1 = r0 + 8;
  const float inv0 = 1.f / l0, inv1 = 1.f / l1;
  if (r0 < t.row_end) {
    bf16* dst = out + (r0 - a.q_begin) * a.ldo + col0 + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) tc::store2(dst + n * 8, o[n][0] * inv0, o[n][1] * inv0);
    if (tq == 0) lse[(r0 - a.q_begin) * a.heads + h] = (m0 + log2f(l0)) * kLn2;
  }
  if (r1 < t.row_end) {
    bf16* dst = out + (r1 - a.q_begin) * a.ldo + col0 + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) tc::store2(dst + n * 8, o[n][2] * inv1, o[n][3] * inv1);
    if (tq == 0) lse[(r1 - a.q_begin) * a.heads + h] = (m1 + log2f(l1)) * kLn2;
  }
}

// delta[r, h] = Σ_c dout[r, h·D + c] · out[r, h·D + c] (f32 from the bf16 values), one warp each.
__global__ void __launch_bounds__(kThreads)
    attn_delta_kernel(const bf16* __restrict__ out, int64_t ldo, const bf16* __restrict__ dout,
                      int64_t lddo, float* __restrict__ delta, int64_t rows, int heads, int hd) {
  const int64_t item = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (item >= rows * heads) return;
  const int64_t r = item / heads;
  const int h = int(item % heads);
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
  for (int c = lane; c < hd; c += 32)
    sum +=
        __bfloat162float(dout[r * lddo + h * hd + c]) * __bfloat162float(out[r * ldo + h * hd + c]);
  sum = detail::warp_sum(sum);
  if (lane == 0) delta[item] = sum;
}

// dQ: one block per (tile of 16·W query rows, head); dQ = scale · dS · K with
// dS = P ⊙ (dO·Vᵀ − delta), P recomputed from the saved log-sum-exp.
template <int D, int W>
__global__ void __launch_bounds__(32 * W)
    attn_dq_kernel(AttnArgs a, const float* __restrict__ lse, const float* __restrict__ delta,
                   bf16* __restrict__ dq) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_do = s_q + kOwnElems<D, W>;
  bf16* s_k = s_do + kOwnElems<D, W>;    // two buffers
  bf16* s_v = s_k + 2 * kOtherElems<D>;  // two buffers
  const auto [t, h, warp, g, tq, col0] = attn_thread<D>(a);
  const int64_t r0 = int64_t(t.row0) + warp * 16 + g, r1 = r0 + 8;
  // Rows past the tile keep P = 0 (their zero-filled queries give finite scores).
  const float lse0 = r0 < t.row_end ? lse[(r0 - a.q_begin) * a.heads + h] * kLog2e : INFINITY;
  const float lse1 = r1 < t.row_end ? lse[(r1 - a.q_begin) * a.heads + h] * kLog2e : INFINITY;
  const float d0 = r0 < t.row_end ? delta[(r0 - a.q_begin) * a.heads + h] : 0.f;
  const float d1 = r1 < t.row_end ? delta[(r1 - a.q_begin) * a.heads + h] : 0.f;
  auto stage_keys = [&](int buf, int kb) {
    stage_keys_values<D, W>(s_k, s_v, a, col0, t.other_end, buf, kb);
  };

  stage_rows<D, 16 * W, 32 * W>(s_q, a.q + col0, a.ldq, t.row0 - a.q_begin, t.row_end - a.q_begin);
  stage_rows<D, 16 * W, 32 * W>(s_do, a.dout + col0, a.ldo, t.row0 - a.q_begin,
                                t.row_end - a.q_begin);
  stage_keys(0, t.other0);
  tc::cp_async_commit();
  float acc[D / 8][4] = {};
  for_each_staged_block(t.other0, t.other_end, stage_keys, [&](int buf, int kb) {
    const bf16* keys = s_k + buf * kOtherElems<D>;
    const bf16* values = s_v + buf * kOtherElems<D>;

    float p[8][4] = {}, dp[8][4] = {};
    product_abt<D>(p, s_q, warp * 16, keys);
    product_abt<D>(dp, s_do, warp * 16, values);
    const int valid = t.other_end - kb;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * tq + (e & 1);
        const float prob =
            col < valid ? exp2f(p[nt][e] * a.scale_log2 - (e < 2 ? lse0 : lse1)) : 0.f;
        p[nt][e] = prob * (dp[nt][e] - (e < 2 ? d0 : d1));
      }
    product_pb<D>(acc, p, keys);
  });
  if (r0 < t.row_end) {
    bf16* dst = dq + (r0 - a.q_begin) * int64_t(a.heads) * D + col0 + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      tc::store2(dst + n * 8, acc[n][0] * a.scale, acc[n][1] * a.scale);
  }
  if (r1 < t.row_end) {
    bf16* dst = dq + (r1 - a.q_begin) * int64_t(a.heads) * D + col0 + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      tc::store2(dst + n * 8, acc[n][2] * a.scale, acc[n][3] * a.scale);
  }
}

// dK and dV: one block per (tile of 16·W key rows, head), over the query rows of the segment:
// dV = Pᵀ·dO, dK = scale · dSᵀ·Q, computed transposed (keys as the rows of every product).
template <int D, int W>
__global__ void __launch_bounds__(32 * W)
    attn_dkdv_kernel(AttnArgs a, const float* __restrict__ lse, const float* __restrict__ delta,
                     bf16* __restrict__ dk, bf16* __restrict__ dv) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_k = reinterpret_cast<bf16*>(smem);
  bf16* s_v = s_k + kOwnElems<D, W>;
  bf16* s_q = s_v + kOwnElems<D, W>;                                   // two buffers
  bf16* s_do = s_q + 2 * kOtherElems<D>;                               // two buffers
  float* s_lse = reinterpret_cast<float*>(s_do + 2 * kOtherElems<D>);  // two buffers
  float* s_delta = s_lse + 2 * kOtherRows;                             // two buffers
  const auto [t, h, warp, g, tq, col0] = attn_thread<D>(a);
  auto stage_queries = [&](int buf, int qb) {
    stage_rows<D, kOtherRows, 32 * W>(s_q + buf * kOtherElems<D>, a.q + col0, a.ldq, qb - a.q_begin,
                                      t.other_end - a.q_begin);
    stage_rows<D, kOtherRows, 32 * W>(s_do + buf * kOtherElems<D>, a.dout + col0, a.ldo,
                                      qb - a.q_begin, t.other_end - a.q_begin);
    if (threadIdx.x < kOtherRows) {
      const int64_t r = qb + threadIdx.x;
      const bool in = r < t.other_end;
      // Query rows past the range get P = 0 (exp2(finite − ∞)).
      s_lse[buf * kOtherRows + threadIdx.x] =
          in ? lse[(r - a.q_begin) * a.heads + h] * kLog2e : INFINITY;
      s_delta[buf * kOtherRows + threadIdx.x] = in ? delta[(r - a.q_begin) * a.heads + h] : 0.f;
    }
  };

  stage_rows<D, 16 * W, 32 * W>(s_k, a.k + col0, a.ldk, t.row0, t.row_end);
  stage_rows<D, 16 * W, 32 * W>(s_v, a.v + col0, a.ldv, t.row0, t.row_end);
  stage_queries(0, t.other0);
  tc::cp_async_commit();
  float acc_k[D / 8][4] = {}, acc_v[D / 8][4] = {};
  for_each_staged_block(t.other0, t.other_end, stage_queries, [&](int buf, int qb) {
    const bf16* queries = s_q + buf * kOtherElems<D>;
    const bf16* douts = s_do + buf * kOtherElems<D>;
    const float* lse_b = s_lse + buf * kOtherRows;
    const float* delta_b = s_delta + buf * kOtherRows;

    float p[8][4] = {}, dp[8][4] = {};
    product_abt<D>(p, s_k, warp * 16, queries);
    product_abt<D>(dp, s_v, warp * 16, douts);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * tq + (e & 1);
        p[nt][e] = exp2f(p[nt][e] * a.scale_log2 - lse_b[col]);
        dp[nt][e] = p[nt][e] * (dp[nt][e] - delta_b[col]);
      }
    product_pb<D>(acc_v, p, douts);
    product_pb<D>(acc_k, dp, queries);
  });
  const int64_t ld = int64_t(a.heads) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // rows g and g + 8: accumulator elements 2r, 2r + 1
    const int64_t key = int64_t(t.row0) + warp * 16 + g + 8 * r;
    if (key >= t.row_end) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      tc::store2(dk + key * ld + col0 + n * 8 + 2 * tq, acc_k[n][2 * r] * a.scale,
                 acc_k[n][2 * r + 1] * a.scale);
      tc::store2(dv + key * ld + col0 + n * 8 + 2 * tq, acc_v[n][2 * r], acc_v[n][2 * r + 1]);
    }
  }
}

// ---- host side -----------------------------------------------------------------------------

unsigned blocks_for(int64_t n, int per_block) { return unsigned((n + per_block - 1) / per_block); }

void check_float_storage(const Tensor& t, const char* op, const char* what) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.device().is_cuda() && t.is_contiguous() &&
                              (t.dtype() == DType::bf16 || t.dtype() == DType::f32),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must be a contiguous bf16 or f32 CUDA tensor");
}

// An operand of the attention: bf16 [rows, H·hd] on `device` with unit inner stride, its rows at
// 16-byte aligned addresses.
void check_operand(const Tensor& t, int64_t rows, int64_t cols, Device device, const char* op,
                   const char* what) {
  GLMTUNE_CUDA_OP_REQUIRE(
      t.defined() && t.device() == device && t.dtype() == DType::bf16 && t.dim() == 2 &&
          t.size(0) == rows && t.size(1) == cols && t.stride(1) == 1 && t.stride(0) % 8 == 0 &&
          detail::aligned16(t.data_ptr()),
      std::string(op) + ": " + what + " " + detail::describe(t) + " must be bf16 [" +
          std::to_string(rows) + ", " + std::to_string(cols) +
          "] on the device of q, with unit column stride and 16-byte aligned rows");
}

// Tiles of `tile_rows` rows: the query tiles (rows of q, keys of their segment) and the key tiles
// (rows of the segments that hold a query row, those query rows).
struct Schedule {
  std::vector<int32_t> query_tiles, key_tiles;
};

Schedule schedule(const std::vector<int64_t>& cu, int64_t q_begin, int64_t q_rows,
                  int64_t tile_rows, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(!cu.empty() && cu.back() <= INT32_MAX,
                          std::string(op) + ": a pack of 2^31 rows or more");
  Schedule s;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t start = cu[i], end = cu[i + 1];
    const int64_t first = std::max(start, q_begin), last = std::min(end, q_begin + q_rows);
    if (first >= last) continue;
    for (int64_t r = first; r < last; r += tile_rows)
      s.query_tiles.insert(s.query_tiles.end(),
                           {int32_t(r), int32_t(last), int32_t(start), int32_t(end)});
    for (int64_t r = start; r < end; r += tile_rows)
      s.key_tiles.insert(s.key_tiles.end(),
                         {int32_t(r), int32_t(end), int32_t(first), int32_t(last)});
  }
  return s;
}

template <typename F>
void dispatch_head_dim(int64_t hd, const char* op, F&& f) {
  switch (hd) {
    case 16:
      return f(std::integral_constant<int, 16>());
    case 32:
      return f(std::integral_constant<int, 32>());
    case 64:
      return f(std::integral_constant<int, 64>());
    case 128:
      return f(std::integral_constant<int, 128>());
    default:
      throw Error(std::string(op) + ": head dim " + std::to_string(hd) +
                      " has no GPU kernel (16, 32, 64 or 128)",
                  op, "use a vision_config whose hidden_size / num_heads is one of these");
  }
}

template <typename Kernel>
void launch_attention(Kernel kernel, const std::vector<int32_t>& tiles, int64_t heads, int threads,
                      int smem, Device device, AttnArgs args, auto... rest) {
  if (tiles.empty()) return;
  const Tensor tiles_dev = detail::device_i32(tiles, device);
  args.tiles = reinterpret_cast<const Tile*>(tiles_dev.data_ptr());
  GLMTUNE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(unsigned(tiles.size() / 4), unsigned(heads));
  kernel<<<grid, threads, smem>>>(args, rest...);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

AttnArgs attention_args(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads,
                        double scale, int64_t q_begin) {
  AttnArgs a{};
  a.q = static_cast<const bf16*>(q.data_ptr());
  a.k = static_cast<const bf16*>(k.data_ptr());
  a.v = static_cast<const bf16*>(v.data_ptr());
  a.ldq = q.stride(0);
  a.ldk = k.stride(0);
  a.ldv = v.stride(0);
  a.q_begin = q_begin;
  a.heads = int(heads);
  a.scale = float(scale);
  a.scale_log2 = float(scale * 1.4426950408889634);
  return a;
}

void check_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::vector<int64_t>& cu, int64_t heads, int64_t q_begin,
                     const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(
      q.defined() && q.device().is_cuda() && q.dim() == 2 && heads >= 1 && q.size(1) % heads == 0,
      std::string(op) + ": q " + detail::describe(q) + " must be a 2-D CUDA tensor of whole heads");
  const int64_t d = q.size(1), n = k.defined() && k.dim() == 2 ? k.size(0) : -1;
  check_operand(q, q.size(0), d, q.device(), op, "q");
  check_operand(k, n, d, q.device(), op, "k");
  check_operand(v, n, d, q.device(), op, "v");
  GLMTUNE_CUDA_OP_REQUIRE(!cu.empty() && cu.front() == 0 && cu.back() == n &&
                              std::is_sorted(cu.begin(), cu.end()) && q_begin >= 0 &&
                              q_begin + q.size(0) <= n,
                          std::string(op) + ": segment bounds or query rows outside the pack");
}

}  // namespace

void rope_2d(Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose) {
  const char* op = transpose ? "cuda::rope_2d_backward" : "cuda::rope_2d";
  check_float_storage(x, op, "x");
  GLMTUNE_CUDA_OP_REQUIRE(cos.defined() && sin.defined() && cos.dtype() == DType::f32 &&
                              sin.dtype() == DType::f32 && cos.is_contiguous() &&
                              sin.is_contiguous() && cos.dim() == 2 && sin.shape() == cos.shape() &&
                              cos.device() == x.device() && sin.device() == x.device(),
                          std::string(op) + ": tables " + detail::describe(cos) + " / " +
                              detail::describe(sin) + " must be f32 [N, hd] on x's device");
  const int64_t n = cos.size(0), hd = cos.size(1);
  GLMTUNE_CUDA_OP_REQUIRE(x.dim() == 2 && x.size(1) == hd && hd % 4 == 0 &&
                              (n == 0 ? x.size(0) == 0 : x.size(0) % n == 0),
                          std::string(op) + ": x " + detail::describe(x) +
                              " must be [N·H, hd] for the tables' positions");
  const int64_t pairs = x.numel() / 2;
  if (pairs == 0) return;
  detail::DeviceGuard guard(x.device().index);
  const int heads = int(x.size(0) / n);
  auto launch = [&]<typename T>(T*) {
    rope_kernel<T><<<blocks_for(pairs, kThreads), kThreads>>>(static_cast<T*>(x.data_ptr()),
                                                              cos.data<float>(), sin.data<float>(),
                                                              pairs, heads, int(hd), transpose);
  };
  if (x.dtype() == DType::f32)
    launch(static_cast<float*>(nullptr));
  else
    launch(static_cast<bf16*>(nullptr));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void gelu_erf(Tensor& x) {
  check_float_storage(x, "cuda::gelu_erf", "x");
  if (x.numel() == 0) return;
  detail::DeviceGuard guard(x.device().index);
  if (x.dtype() == DType::f32)
    gelu_kernel<<<blocks_for(x.numel(), kThreads), kThreads>>>(x.data<float>(), x.numel());
  else
    gelu_kernel<<<blocks_for(x.numel(), kThreads), kThreads>>>(static_cast<bf16*>(x.data_ptr()),
                                                               x.numel());
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void gelu_erf_backward(const Tensor& x, Tensor& dy) {
  check_float_storage(x, "cuda::gelu_erf_backward", "x");
  check_float_storage(dy, "cuda::gelu_erf_backward", "dy");
  GLMTUNE_CUDA_OP_REQUIRE(
      dy.shape() == x.shape() && dy.dtype() == x.dtype() && dy.device() == x.device(),
      "cuda::gelu_erf_backward: dy " + detail::describe(dy) + " must be shaped like x " +
          detail::describe(x));
  if (x.numel() == 0) return;
  detail::DeviceGuard guard(x.device().index);
  if (x.dtype() == DType::f32)
    gelu_backward_kernel<<<blocks_for(x.numel(), kThreads), kThreads>>>(
        x.data<float>(), dy.data<float>(), x.numel());
  else
    gelu_backward_kernel<<<blocks_for(x.numel(), kThreads), kThreads>>>(
        static_cast<const bf16*>(x.data_ptr()), static_cast<bf16*>(dy.data_ptr()), x.numel());
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

void varlen_attention(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                      const std::vector<int64_t>& cu_seqlens, int64_t heads, double scale,
                      int64_t q_begin) {
  const char* op = "cuda::varlen_attention";
  check_attention(q, k, v, cu_seqlens, heads, q_begin, op);
  const int64_t nq = q.size(0), d = q.size(1), hd = d / heads;
  check_operand(out, nq, d, q.device(), op, "out");
  GLMTUNE_CUDA_OP_REQUIRE(
      out.is_contiguous() && lse.defined() && lse.dtype() == DType::f32 && lse.is_contiguous() &&
          lse.device() == q.device() && lse.shape() == Shape({nq, heads}),
      std::string(op) + ": out " + detail::describe(out) + " / lse " + detail::describe(lse) +
          " must be contiguous [Nq, H·hd] / f32 [Nq, H]");
  constexpr int W = kForwardWarps;
  const Schedule s = schedule(cu_seqlens, q_begin, nq, 16 * W, op);
  detail::DeviceGuard guard(q.device().index);
  AttnArgs a = attention_args(q, k, v, heads, scale, q_begin);
  a.ldo = d;
  dispatch_head_dim(hd, op, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    launch_attention(attn_forward_kernel<D, W>, s.query_tiles, heads, 32 * W,
                     (kOwnElems<D, W> + 4 * kOtherElems<D>)*2, q.device(), a,
                     static_cast<bf16*>(out.data_ptr()), lse.data<float>());
  });
}

void varlen_attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& dout,
                               const Tensor& lse, const std::vector<int64_t>& cu_seqlens,
                               int64_t heads, double scale, int64_t q_begin) {
  const char* op = "cuda::varlen_attention_backward";
  check_attention(q, k, v, cu_seqlens, heads, q_begin, op);
  const int64_t nq = q.size(0), n = k.size(0), d = q.size(1), hd = d / heads;
  check_operand(out, nq, d, q.device(), op, "out");
  check_operand(dout, nq, d, q.device(), op, "dout");
  GLMTUNE_CUDA_OP_REQUIRE(out.stride(0) == dout.stride(0),
                          std::string(op) + ": out and dout must share a row stride");
  check_operand(dq, nq, d, q.device(), op, "dq");
  check_operand(dk, n, d, q.device(), op, "dk");
  check_operand(dv, n, d, q.device(), op, "dv");
  GLMTUNE_CUDA_OP_REQUIRE(dq.is_contiguous() && dk.is_contiguous() && dv.is_contiguous() &&
                              lse.defined() && lse.dtype() == DType::f32 && lse.is_contiguous() &&
                              lse.device() == q.device() && lse.shape() == Shape({nq, heads}),
                          std::string(op) + ": dq, dk, dv must be contiguous and lse " +
                              detail::describe(lse) + " f32 [Nq, H]");
  if (n == 0) return;
  constexpr int W = kBackwardWarps;
  const Schedule s = schedule(cu_seqlens, q_begin, nq, 16 * W, op);
  detail::DeviceGuard guard(q.device().index);
  GLMTUNE_CUDA_CHECK(cudaMemsetAsync(dk.data_ptr(), 0, dk.nbytes()));
  GLMTUNE_CUDA_CHECK(cudaMemsetAsync(dv.data_ptr(), 0, dv.nbytes()));
  if (nq == 0) return;
  Tensor delta = Tensor::empty({nq, heads}, DType::f32, q.device());
  attn_delta_kernel<<<blocks_for(nq * heads, kThreads / 32), kThreads>>>(
      static_cast<const bf16*>(out.data_ptr()), out.stride(0),
      static_cast<const bf16*>(dout.data_ptr()), dout.stride(0), delta.data<float>(), nq,
      int(heads), int(hd));
  GLMTUNE_CUDA_CHECK_LAUNCH();
  AttnArgs a = attention_args(q, k, v, heads, scale, q_begin);
  a.dout = static_cast<const bf16*>(dout.data_ptr());
  a.ldo = dout.stride(0);
  dispatch_head_dim(hd, op, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    const int tile_bytes = (2 * kOwnElems<D, W> + 4 * kOtherElems<D>)*2;
    launch_attention(attn_dkdv_kernel<D, W>, s.key_tiles, heads, 32 * W,
                     tile_bytes + 4 * kOtherRows * int(sizeof(float)), q.device(), a,
                     lse.data<float>(), static_cast<const float*>(delta.data<float>()),
                     static_cast<bf16*>(dk.data_ptr()), static_cast<bf16*>(dv.data_ptr()));
    launch_attention(attn_dq_kernel<D, W>, s.query_tiles, heads, 32 * W, tile_bytes, q.device(), a,
                     static_cast<const float*>(lse.data<float>()),
                     static_cast<const float*>(delta.data<float>()),
                     static_cast<bf16*>(dq.data_ptr()));
  });
}

}  // namespace glmtune::cuda
